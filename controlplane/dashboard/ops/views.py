"""The operators' pages: the fleet (live), its actions, the audit log and the catalog.

Every action calls a service (which validates, audits and sends the Celery task after commit). An
htmx request gets back the fragment it replaces, with the service's errors beside the fields; a
plain form post (no JavaScript) is redirected back to the page with a message (`dashboard.htmx`).
"""

from functools import partial

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from controlplane.audit.selectors import audit_actor_labels, audit_entries
from controlplane.catalog.models import Deployment, Model
from controlplane.catalog.selectors import weights_path_reports
from controlplane.catalog.services import model_create, model_set_enabled, model_update
from controlplane.dashboard.forms import form_error_messages, submit
from controlplane.dashboard.htmx import fragment_or_redirect, run_action
from controlplane.dashboard.ops.forms import (
    AuditFilterForm,
    CatalogModelForm,
    DeploymentLimitsForm,
    LoadForm,
    ScaleForm,
)
from controlplane.dashboard.ops.fragments import deployment_context
from controlplane.dashboard.ops.overview import FigureHistory, deployment_views, worker_views
from controlplane.dashboard.permissions import operator_required
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.selectors import deployment_statuses, workers_for_path_check
from controlplane.fleet.services.deployments import (
    deployment_create,
    deployment_retry_loads,
    deployment_scale,
    deployment_update,
)
from controlplane.fleet.services.replicas import replica_load_on, replica_unload
from controlplane.fleet.services.workers import worker_drain

AUDIT_PAGE_SIZE = 50
FLEET, CATALOG = "dashboard:fleet", "dashboard:catalog"


# --- Fleet -------------------------------------------------------------------------------------

@operator_required
@require_GET
def fleet(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/ops/fleet.html", {
        "workers": worker_views(history=FigureHistory.recent()),
        "deployments": [deployment_context(view) for view in deployment_views()],
        "load_form": LoadForm(),
    })


def _render_deployment(request, deployment_id: int, *, action_error: str = "", **forms) -> HttpResponse:
    (view,) = deployment_views(deployment_ids=[deployment_id])
    return render(request, "dashboard/ops/_deployment.html", {"d": deployment_context(view, **forms),
                                                              "action_error": action_error})


@operator_required
@require_POST
def deployment_scale_view(request: HttpRequest, pk: int) -> HttpResponse:
    deployment = get_object_or_404(Deployment.objects.select_related("model"), pk=pk)
    form = ScaleForm(request.POST, prefix=f"s{pk}")
    requested = form.cleaned_data["desired_replicas"] if form.is_valid() else None
    if submit(form, lambda data: deployment_scale(deployment=deployment, desired_replicas=data["desired_replicas"],
                                                  actor=request.user)) is None:
        fix = {}
        if requested is not None:
            # A well-formed count the service refused (outside Min..Max): the limits form opens,
            # filled in to allow it.
            fix = {"open_limits": True, "limits_form": DeploymentLimitsForm.for_deployment(deployment, reach=requested)}
        return fragment_or_redirect(request, lambda: _render_deployment(request, pk, scale_form=form, **fix),
                                    to=FLEET, errors=form_error_messages(form))
    return fragment_or_redirect(request, lambda: _render_deployment(request, pk), to=FLEET, success=(
        f"{deployment.model.public_name} now wants {form.cleaned_data['desired_replicas']} replicas."))


@operator_required
@require_POST
def deployment_edit_view(request: HttpRequest, pk: int) -> HttpResponse:
    deployment = get_object_or_404(Deployment.objects.select_related("model"), pk=pk)
    form = DeploymentLimitsForm(request.POST, prefix=f"d{pk}")
    if submit(form, lambda data: deployment_update(deployment=deployment, actor=request.user, **data)) is None:
        return fragment_or_redirect(
            request, lambda: _render_deployment(request, pk, limits_form=form, open_limits=True), to=FLEET,
            errors=form_error_messages(form))
    return fragment_or_redirect(request, lambda: _render_deployment(request, pk), to=FLEET,
                                success=f"{deployment.model.public_name} updated.")


@operator_required
@require_POST
def deployment_retry_view(request: HttpRequest, pk: int) -> HttpResponse:
    deployment = get_object_or_404(Deployment.objects.select_related("model"), pk=pk)
    return run_action(request, lambda: deployment_retry_loads(deployment=deployment, actor=request.user),
                      partial(_render_deployment, request, pk), to=FLEET,
                      success=f"Retrying {deployment.model.public_name} on every worker now.")


def _render_load_form(request, form, *, done: str = "", worker_id: int | None = None) -> HttpResponse:
    context = {"load_form": form, "load_done": done}
    if worker_id is not None:  # the new replica's worker card, swapped out of band
        context["oob_workers"] = worker_views(worker_ids=[worker_id])
    return render(request, "dashboard/ops/_load_form.html", context)


@operator_required
@require_POST
def replica_load_view(request: HttpRequest) -> HttpResponse:
    form = LoadForm(request.POST)
    replica = submit(form, lambda data: replica_load_on(deployment=data["deployment"], worker=data["slot"][0],
                                                        gpu=data["slot"][1], actor=request.user),
                     rename={"worker": "slot", "gpu": "slot"})
    if replica is None:
        return fragment_or_redirect(request, lambda: _render_load_form(request, form), to=FLEET,
                                    errors=form_error_messages(form))
    (worker, gpu), deployment = form.cleaned_data["slot"], form.cleaned_data["deployment"]
    where = f"GPU {gpu.index} of {worker.name}" if gpu is not None else worker.name
    message = f"Loading {deployment.model.public_name} on {where} (replica {replica.pk})."
    return fragment_or_redirect(request, lambda: _render_load_form(request, LoadForm(), done=message,
                                                                   worker_id=worker.pk), to=FLEET, success=message)


def _render_worker(request, worker_id: int, *, action_error: str = "") -> HttpResponse:
    (view,) = worker_views(worker_ids=[worker_id])
    return render(request, "dashboard/ops/_worker.html", {"w": view, "action_error": action_error})


@operator_required
@require_POST
def replica_unload_view(request: HttpRequest, pk: int) -> HttpResponse:
    replica = get_object_or_404(Replica.objects.select_related("deployment__model", "worker"), pk=pk)
    return run_action(request, lambda: replica_unload(replica=replica, actor=request.user),
                      partial(_render_worker, request, replica.worker_id), to=FLEET,
                      success=f"Unloading replica {pk} of {replica.deployment.model.public_name}.")


@operator_required
@require_POST
def worker_drain_view(request: HttpRequest, pk: int) -> HttpResponse:
    worker = get_object_or_404(Worker, pk=pk)
    return run_action(request, lambda: worker_drain(worker=worker, actor=request.user),
                      partial(_render_worker, request, pk), to=FLEET, success=f"Draining {worker.name}.")


# --- Audit log ---------------------------------------------------------------------------------

@operator_required
@require_GET
def audit(request: HttpRequest) -> HttpResponse:
    form = AuditFilterForm(request.GET or None, actors=audit_actor_labels())
    filters = form.cleaned_data if form.is_valid() else {}
    entries = audit_entries(action=filters.get("action", ""), actor=filters.get("actor", ""))
    page = Paginator(entries.select_related("actor"), AUDIT_PAGE_SIZE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    context = {"form": form, "page": page, "query": query.urlencode()}
    template = "dashboard/ops/_audit_table.html" if request.htmx else "dashboard/ops/audit.html"
    return render(request, template, context)


# --- Catalog -----------------------------------------------------------------------------------

@operator_required
@require_GET
def catalog(request: HttpRequest) -> HttpResponse:
    models = _with_fleet_status(Model.objects.select_related("price_tier", "deployment").order_by("public_name"))
    return render(request, "dashboard/ops/catalog.html", {"models": models})


def _with_fleet_status(models) -> list[Model]:
    """The models, each with `fleet_status`: its deployment's status (None when not deployed), so
    the list can say which are degraded and why."""
    models = list(models)
    deployed = [m.deployment.pk for m in models if hasattr(m, "deployment")]
    statuses = {s.deployment_id: s for s in deployment_statuses(deployment_ids=deployed)} if deployed else {}
    for m in models:
        m.fleet_status = statuses.get(m.deployment.pk) if hasattr(m, "deployment") else None
    return models


def _path_notes(form: CatalogModelForm) -> list:
    """Said after saving: a path no chosen worker confirmed (the chosen ones must all have it)."""
    if not form.cleaned_data.get("check_workers"):
        return ["The weight path was not checked: no worker was chosen."]
    return []


def _catalog_form_page(request, form, model=None) -> HttpResponse:
    return render(request, "dashboard/ops/catalog_form.html", {"form": form, "model": model})


@operator_required
def catalog_add(request: HttpRequest) -> HttpResponse:
    form = CatalogModelForm(request.POST or None)
    model = submit(form, lambda data: model_create(actor=request.user, verify_on=list(data["check_workers"]),
                                                   **form.model_fields()))
    if model is None:  # a GET, or refused
        return _catalog_form_page(request, form)
    messages.success(request, f"Added {model.public_name}.")
    for note in _path_notes(form):
        messages.warning(request, note)
    return redirect(CATALOG)


@operator_required
def catalog_edit(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(Model, pk=pk)
    form = CatalogModelForm(request.POST or None, instance=model)
    saved = submit(form, lambda data: model_update(model=model, actor=request.user,
                                                   verify_on=list(data["check_workers"]), **form.model_fields()))
    if saved is None:  # a GET, or refused
        return _catalog_form_page(request, form, model=Model.objects.get(pk=pk))
    messages.success(request, f"Saved {saved.public_name}.")
    if "weights_path" in form.changed_data:
        for note in _path_notes(form):
            messages.warning(request, note)
    return redirect(CATALOG)


def _catalog_row(request, model_id: int, *, action_error: str = "") -> HttpResponse:
    [model] = _with_fleet_status(Model.objects.select_related("price_tier", "deployment").filter(pk=model_id))
    return render(request, "dashboard/ops/_catalog_row.html", {"m": model, "action_error": action_error})


@operator_required
@require_POST
def catalog_set_enabled(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(Model, pk=pk)
    enabled = request.POST.get("enabled") == "1"
    model = model_set_enabled(model=model, enabled=enabled, actor=request.user)
    return fragment_or_redirect(request, lambda: _catalog_row(request, pk), to=CATALOG,
                                success=f"{model.public_name} {'enabled' if enabled else 'disabled'}.")


@operator_required
@require_POST
def catalog_deploy(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(Model, pk=pk)
    deploy = partial(deployment_create, model_name=model.public_name, desired_replicas=1, min_replicas=0,
                     max_replicas=1, actor=request.user)
    return run_action(request, deploy, partial(_catalog_row, request, pk), to=CATALOG,
                      success=f"{model.public_name} deployed with one replica; scale it on the fleet page.")


@operator_required
@require_GET
def catalog_path_check(request: HttpRequest) -> HttpResponse:
    """The chosen workers' view of a weight path, while the operator types it."""
    path = request.GET.get("weights_path", "").strip()
    ids = [int(i) for i in request.GET.getlist("check_workers") if i.isdigit()]
    workers = list(workers_for_path_check().filter(pk__in=ids))
    reports = weights_path_reports(weights_path=path, workers=workers) if path.startswith("/") else []
    return render(request, "dashboard/ops/_path_check.html", {"path": path, "reports": reports, "workers": workers})
