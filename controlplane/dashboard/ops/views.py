"""The operators' pages: the fleet (live), its actions, the audit log and the catalog.

Every action calls a service (which validates, audits, publishes the change to the fleet pages and
sends the Celery task after commit). On the fleet page each part has one renderer: the live parts
(worker cards, deployment statuses) come only from `fragments`, over the page's WebSocket; an htmx
action gets back only what is its own, its form with the service's errors beside the fields or a
line saying what was done, and the change reaches the page with the live push like anyone else's.
Its answer also says `fleet-changed`, so a page whose WebSocket is down fetches the live parts over
HTTP (`fleet_live`). A plain form post (no JavaScript) is redirected back to the page with a
message (`dashboard.htmx`).
"""

from functools import partial

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import trigger_client_event

from controlplane.audit.selectors import audit_actor_labels, audit_entries
from controlplane.catalog.checkpoints import checkpoint_lookup
from controlplane.catalog.models import Deployment
from controlplane.catalog.selectors import catalog_models, deployments_with_model, weights_path_reports
from controlplane.catalog.services import model_create, model_update
from controlplane.dashboard.forms import form_error_messages, submit
from controlplane.dashboard.htmx import fragment_or_redirect, run_action
from controlplane.dashboard.ops import fragments
from controlplane.dashboard.ops.forms import (
    AuditFilterForm,
    CatalogModelForm,
    CheckpointForm,
    DeploymentLimitsForm,
    LoadForm,
    ScaleForm,
)
from controlplane.dashboard.ops.overview import FigureHistory, deployment_views, worker_views
from controlplane.dashboard.permissions import operator_required
from controlplane.fleet.selectors import (
    models_with_fleet_status,
    replicas_with_model_and_worker,
    workers_all,
    workers_for_path_check,
    workers_online,
)
from controlplane.fleet.services.deployments import (
    deployment_create,
    deployment_retry_loads,
    deployment_scale,
    deployment_update,
)
from controlplane.fleet.services.model_lifecycle import model_delete, model_set_serving
from controlplane.fleet.services.quality import quality_measurement_request
from controlplane.fleet.services.replicas import replica_load_on, replica_unload
from controlplane.fleet.services.workers import worker_drain

AUDIT_PAGE_SIZE = 50
FLEET, CATALOG = "dashboard:fleet", "dashboard:catalog"
# What an answer to a change on the fleet page says (HX-Trigger): the page's catch-up listens for
# it while its WebSocket is down (fleet.html).
FLEET_CHANGED = "fleet-changed"
WORKERS_ANSWER_ID = "workers-answer"


# --- Fleet -------------------------------------------------------------------------------------


@operator_required
@require_GET
def fleet(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "dashboard/ops/fleet.html",
        {
            "workers": worker_views(history=FigureHistory.recent()),
            "deployments": [fragments.deployment_context(view) for view in deployment_views()],
            "load_form": LoadForm(),
            "workers_answer_id": WORKERS_ANSWER_ID,
        },
    )


@operator_required
@require_GET
def fleet_live(request: HttpRequest) -> HttpResponse:
    """The fleet page's live parts as they are now, for a page whose WebSocket is down: what a
    reconnecting socket gets, each part marked for htmx to swap in by id."""
    return HttpResponse(fragments.resync_fragment(FigureHistory.recent(), oob=True))


def _answered(response: HttpResponse, *, changed: bool) -> HttpResponse:
    """An action's answer; after a change it says so, and a page whose WebSocket is down catches up
    over HTTP (a refusal changed nothing)."""
    return trigger_client_event(response, FLEET_CHANGED) if changed else response


def _scale_answer(
    request,
    deployment: Deployment,
    *,
    form: ScaleForm | None = None,
    done: str = "",
    limits_form: DeploymentLimitsForm | None = None,
) -> HttpResponse:
    """The scale form (fresh after `done`, else with its errors); with `limits_form`, the limits
    too, opened out of band."""
    html = render_to_string(
        "dashboard/ops/_scale_form.html",
        {"dep": deployment, "form": form or ScaleForm.for_deployment(deployment), "done": done},
        request=request,
    )
    if limits_form is not None:
        html += render_to_string(
            "dashboard/ops/_limits_form.html",
            {"dep": deployment, "form": limits_form, "open": True, "oob": True},
            request=request,
        )
    return _answered(HttpResponse(html), changed=bool(done))


@operator_required
@require_POST
def deployment_scale_view(request: HttpRequest, pk: int) -> HttpResponse:
    deployment = get_object_or_404(deployments_with_model(), pk=pk)
    form = ScaleForm(request.POST, prefix=f"s{pk}")
    requested = form.cleaned_data["desired_replicas"] if form.is_valid() else None
    scaled = submit(
        form,
        lambda data: deployment_scale(
            deployment=deployment, desired_replicas=data["desired_replicas"], actor=request.user
        ),
    )
    if scaled is None:
        # A well-formed count the service refused (outside Min..Max): the limits form opens,
        # filled in to allow it.
        fix = DeploymentLimitsForm.for_deployment(deployment, reach=requested) if requested is not None else None
        return fragment_or_redirect(
            request,
            lambda: _scale_answer(request, deployment, form=form, limits_form=fix),
            to=FLEET,
            errors=form_error_messages(form),
        )
    done = f"{deployment.model.public_name} now wants {scaled.desired_replicas} replicas."
    return fragment_or_redirect(request, lambda: _scale_answer(request, scaled, done=done), to=FLEET, success=done)


def _limits_answer(
    request, deployment: Deployment, *, form: DeploymentLimitsForm | None = None, done: str = ""
) -> HttpResponse:
    """The limits form: closed and filled with the saved settings after `done`, else open with its errors."""
    return _answered(
        render(
            request,
            "dashboard/ops/_limits_form.html",
            {
                "dep": deployment,
                "form": form or DeploymentLimitsForm.for_deployment(deployment),
                "open": not done,
                "done": done,
            },
        ),
        changed=bool(done),
    )


@operator_required
@require_POST
def deployment_edit_view(request: HttpRequest, pk: int) -> HttpResponse:
    deployment = get_object_or_404(deployments_with_model(), pk=pk)
    form = DeploymentLimitsForm(request.POST, prefix=f"d{pk}")
    saved = submit(form, lambda data: deployment_update(deployment=deployment, actor=request.user, **data))
    if saved is None:
        return fragment_or_redirect(
            request, lambda: _limits_answer(request, deployment, form=form), to=FLEET, errors=form_error_messages(form)
        )
    done = f"{deployment.model.public_name} updated."
    return fragment_or_redirect(request, lambda: _limits_answer(request, saved, done=done), to=FLEET, success=done)


def _answer(request, answer_id: str, *, done: str = "", action_error: str = "") -> HttpResponse:
    """A button's answer line: what was done (the page catches up if its WebSocket is down), or why
    not (`action_error`: nothing changed)."""
    return _answered(
        render(
            request,
            "dashboard/ops/_answer.html",
            {"answer_id": answer_id, "done": "" if action_error else done, "action_error": action_error},
        ),
        changed=not action_error,
    )


def _run_button(request, action, *, answer_id: str, to: str, success: str) -> HttpResponse:
    return run_action(request, action, partial(_answer, request, answer_id, done=success), to=to, success=success)


@operator_required
@require_POST
def deployment_retry_view(request: HttpRequest, pk: int) -> HttpResponse:
    deployment = get_object_or_404(deployments_with_model(), pk=pk)
    return _run_button(
        request,
        lambda: deployment_retry_loads(deployment=deployment, actor=request.user),
        answer_id=fragments.deployment_answer_id(pk),
        to=FLEET,
        success=f"Retrying {deployment.model.public_name} on every worker now.",
    )


def _render_load_form(request, form, *, done: str = "") -> HttpResponse:
    return _answered(
        render(request, "dashboard/ops/_load_form.html", {"load_form": form, "load_done": done}), changed=bool(done)
    )


@operator_required
@require_POST
def replica_load_view(request: HttpRequest) -> HttpResponse:
    form = LoadForm(request.POST)
    replica = submit(
        form,
        lambda data: replica_load_on(
            deployment=data["deployment"], worker=data["slot"][0], gpu=data["slot"][1], actor=request.user
        ),
        rename={"worker": "slot", "gpu": "slot"},
    )
    if replica is None:
        return fragment_or_redirect(
            request, lambda: _render_load_form(request, form), to=FLEET, errors=form_error_messages(form)
        )
    (worker, gpu), deployment = form.cleaned_data["slot"], form.cleaned_data["deployment"]
    where = f"GPU {gpu.index} of {worker.name}" if gpu is not None else worker.name
    message = f"Loading {deployment.model.public_name} on {where} (replica {replica.pk})."
    return fragment_or_redirect(
        request, lambda: _render_load_form(request, LoadForm(), done=message), to=FLEET, success=message
    )


@operator_required
@require_POST
def replica_unload_view(request: HttpRequest, pk: int) -> HttpResponse:
    replica = get_object_or_404(replicas_with_model_and_worker(), pk=pk)
    return _run_button(
        request,
        lambda: replica_unload(replica=replica, actor=request.user),
        answer_id=WORKERS_ANSWER_ID,
        to=FLEET,
        success=f"Unloading replica {pk} of {replica.deployment.model.public_name}.",
    )


@operator_required
@require_POST
def worker_drain_view(request: HttpRequest, pk: int) -> HttpResponse:
    worker = get_object_or_404(workers_all(), pk=pk)
    return _run_button(
        request,
        lambda: worker_drain(worker=worker, actor=request.user),
        answer_id=WORKERS_ANSWER_ID,
        to=FLEET,
        success=f"Draining {worker.name}.",
    )


# --- Audit log ---------------------------------------------------------------------------------


@operator_required
@require_GET
def audit(request: HttpRequest) -> HttpResponse:
    form = AuditFilterForm(request.GET or None, actors=audit_actor_labels())
    filters = form.cleaned_data if form.is_valid() else {}
    entries = audit_entries(action=filters.get("action", ""), actor=filters.get("actor", ""))
    page = Paginator(entries, AUDIT_PAGE_SIZE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    context = {"form": form, "page": page, "query": query.urlencode()}
    template = "dashboard/ops/_audit_table.html" if request.htmx else "dashboard/ops/audit.html"
    return render(request, template, context)


# --- Catalog -----------------------------------------------------------------------------------


@operator_required
@require_GET
def catalog(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/ops/catalog.html", {"models": models_with_fleet_status()})


def _path_notes(form: CatalogModelForm) -> list:
    """Said after saving: a path no chosen worker confirmed (the chosen ones must all have it)."""
    if not form.cleaned_data.get("check_workers"):
        return ["The weight path was not checked: no worker was chosen."]
    return []


def _catalog_form_page(request, form, model=None, **extra) -> HttpResponse:
    return render(request, "dashboard/ops/catalog_form.html", {"form": form, "model": model, **extra})


def _catalog_add_from_checkpoint(request: HttpRequest) -> HttpResponse:
    """The add-model form filled from what a worker read in the named checkpoint, or the reason
    it could not be, beside the checkpoint field."""
    reader = CheckpointForm(request.GET)
    facts = submit(reader, lambda data: checkpoint_lookup(reference=data["checkpoint"], workers=workers_online()))
    form = CatalogModelForm(initial=facts.model_initial()) if facts is not None else CatalogModelForm()
    return _catalog_form_page(request, form, checkpoint_form=reader, checkpoint_facts=facts)


@operator_required
def catalog_add(request: HttpRequest) -> HttpResponse:
    if request.method == "GET" and "checkpoint" in request.GET:
        return _catalog_add_from_checkpoint(request)
    form = CatalogModelForm(request.POST or None)
    model = submit(
        form,
        lambda data: model_create(actor=request.user, verify_on=list(data["check_workers"]), **form.model_fields()),
    )
    if model is None:  # a GET, or refused
        return _catalog_form_page(request, form, checkpoint_form=CheckpointForm())
    messages.success(request, f"Added {model.public_name}.")
    for note in _path_notes(form):
        messages.warning(request, note)
    return redirect(CATALOG)


@operator_required
def catalog_edit(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(catalog_models(), pk=pk)
    form = CatalogModelForm(request.POST or None, instance=model)
    saved = submit(
        form,
        lambda data: model_update(
            model=model, actor=request.user, verify_on=list(data["check_workers"]), **form.model_fields()
        ),
    )
    if saved is None:  # a GET, or refused
        return _catalog_form_page(request, form, model=get_object_or_404(catalog_models(), pk=pk))
    messages.success(request, f"Saved {saved.public_name}.")
    if "weights_path" in form.changed_data:
        for note in _path_notes(form):
            messages.warning(request, note)
    return redirect(CATALOG)


def _catalog_row(request, model_id: int, *, action_error: str = "") -> HttpResponse:
    [model] = models_with_fleet_status(model_ids=[model_id])
    return render(request, "dashboard/ops/_catalog_row.html", {"m": model, "action_error": action_error})


@operator_required
@require_POST
def catalog_set_enabled(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(catalog_models(), pk=pk)
    enabled = request.POST.get("enabled") == "1"
    model = model_set_serving(model=model, enabled=enabled, actor=request.user)
    outcome = "enabled: its replicas load again" if enabled else "disabled: its replicas unload"
    return fragment_or_redirect(
        request, lambda: _catalog_row(request, pk), to=CATALOG, success=f"{model.public_name} {outcome}."
    )


@operator_required
@require_POST
def catalog_delete(request: HttpRequest, pk: int) -> HttpResponse:
    """Delete a model no replica runs; htmx gets an empty answer that removes its row, or the row
    with the refusal beside the button."""
    model = get_object_or_404(catalog_models(), pk=pk)

    def answer(action_error: str = "") -> HttpResponse:
        return _catalog_row(request, pk, action_error=action_error) if action_error else HttpResponse("")

    return run_action(
        request,
        partial(model_delete, model=model, actor=request.user),
        answer,
        to=CATALOG,
        success=f"{model.public_name} deleted.",
    )


@operator_required
@require_POST
def catalog_deploy(request: HttpRequest, pk: int) -> HttpResponse:
    model = get_object_or_404(catalog_models(), pk=pk)
    deploy = partial(
        deployment_create,
        model_name=model.public_name,
        desired_replicas=1,
        min_replicas=0,
        max_replicas=1,
        actor=request.user,
    )
    return run_action(
        request,
        deploy,
        partial(_catalog_row, request, pk),
        to=CATALOG,
        success=f"{model.public_name} deployed with one replica; scale it on the fleet page.",
    )


@operator_required
@require_POST
def catalog_measure_quality(request: HttpRequest, pk: int) -> HttpResponse:
    """Ask a worker to measure the model's perplexity; the row then shows the measurement's progress."""
    model = get_object_or_404(catalog_models(), pk=pk)
    return run_action(
        request,
        partial(quality_measurement_request, model=model, actor=request.user),
        partial(_catalog_row, request, pk),
        to=CATALOG,
        success=f"{model.public_name}'s quality measurement is queued.",
    )


@operator_required
@require_GET
def catalog_row(request: HttpRequest, pk: int) -> HttpResponse:
    """One catalog row: what a row polls while its quality measurement is in progress."""
    get_object_or_404(catalog_models(), pk=pk)
    return _catalog_row(request, pk)


@operator_required
@require_GET
def catalog_path_check(request: HttpRequest) -> HttpResponse:
    """The chosen workers' view of a weight path, while the operator types it."""
    path = request.GET.get("weights_path", "").strip()
    ids = [int(i) for i in request.GET.getlist("check_workers") if i.isdigit()]
    workers = list(workers_for_path_check(worker_ids=ids))
    reports = weights_path_reports(weights_path=path, workers=workers) if path.startswith("/") else []
    return render(request, "dashboard/ops/_path_check.html", {"path": path, "reports": reports, "workers": workers})
