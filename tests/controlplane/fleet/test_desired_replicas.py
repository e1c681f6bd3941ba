"""One writer of a deployment's desired replica count (`deployment_set_desired_replicas`), with the one
bounds check: nothing else in the control plane assigns the count, and the bounds hold for every
caller (an operator's scale or edit, a load or unload by hand, the autoscaler, a cold start)."""

import ast
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from controlplane.catalog.models import Deployment
from controlplane.fleet.models import Replica
from controlplane.fleet.services.deployments import deployment_scale, deployment_set_desired_replicas, deployment_update
from controlplane.fleet.services.replicas import replica_load_on, replica_unload
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ReplicaFactory

ROOT = Path(__file__).resolve().parents[3]
WRITER = ("controlplane/fleet/services/deployments.py", "deployment_set_desired_replicas")
# A deployment's first count is set where it is created, checked by the model's constraint.
CREATION = ("controlplane/fleet/services/deployments.py", "deployment_create")
# Calls whose keyword `desired_replicas=` writes a row: the constructor, or a queryset's writes
# (`Deployment.objects.create(...)`, `....filter(...).update(...)`; a dict's update is no write).
QUERYSET_WRITES = {"create", "get_or_create", "update_or_create", "update"}


def _desired_replicas_writes(source: str, path: str) -> list[tuple[str, int, str]]:
    """(path, line, enclosing function) of each write of `desired_replicas` in the source: an
    assignment to the attribute (`=`, `+=`, annotated), a setattr naming it, or a keyword of the
    constructor or of a queryset write."""
    writes = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        elements = [e for target in targets for e in (target.elts if isinstance(target, ast.Tuple) else [target])]
        if any(isinstance(e, ast.Attribute) and e.attr == "desired_replicas" for e in elements):
            writes.append((path, node.lineno, function))
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            on_queryset = isinstance(func, ast.Attribute) and (
                isinstance(func.value, ast.Call) or getattr(func.value, "attr", "") == "objects"
            )
            keyword = any(k.arg == "desired_replicas" for k in node.keywords)
            if (
                name == "setattr"
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "desired_replicas"
            ):
                writes.append((path, node.lineno, function))
            elif keyword and (name == "Deployment" or name in QUERYSET_WRITES and on_queryset):
                writes.append((path, node.lineno, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source, path), "")
    return writes


def test_the_scan_finds_every_kind_of_write():
    source = """
def a(d):
    d.desired_replicas = 2
def b(d):
    d.desired_replicas += 1
def c(d):
    d.desired_replicas, d.scaled_at = 1, None
def e(d):
    setattr(d, "desired_replicas", 3)
def f():
    Deployment.objects.filter(pk=1).update(desired_replicas=0)
def g(m):
    Deployment(model=m, desired_replicas=1)
def h(m):
    Deployment.objects.create(model=m, desired_replicas=1)
def reads(d, initial):
    print(d.desired_replicas, deployment_scale(deployment=d, desired_replicas=2))
    initial.update(desired_replicas=d.desired_replicas)
"""
    assert [function for _, _, function in _desired_replicas_writes(source, "x.py")] == list("abcefgh")


def test_nothing_but_the_one_writer_assigns_the_desired_replica_count():
    writes = []
    for path in sorted((ROOT / "controlplane").rglob("*.py")):
        if "migrations" not in path.parts:
            relative = str(path.relative_to(ROOT))
            writes += _desired_replicas_writes(path.read_text(), relative)
    allowed = [w for w in writes if (w[0], w[2]) in (WRITER, CREATION)]
    assert {(w[0], w[2]) for w in allowed} == {WRITER, CREATION}  # the scan sees the writer itself
    others = [
        f"{path}:{line} in {function or 'module'}"
        for path, line, function in writes
        if (path, function) not in (WRITER, CREATION)
    ]
    assert others == [], "write desired_replicas through deployment_set_desired_replicas: " + ", ".join(others)


# --- The bounds -----------------------------------------------------------------------------------


def _stored(deployment) -> Deployment:
    return Deployment.objects.get(pk=deployment.pk)


@pytest.mark.django_db
@pytest.mark.parametrize("desired", [1, 2, 4])
def test_a_count_within_the_bounds_inclusive_is_written_with_the_scaling_time(desired):
    deployment = DeploymentFactory(
        desired_replicas=2, min_replicas=1, max_replicas=4, scaled_at=timezone.now() - timedelta(hours=1)
    )
    now = timezone.now()
    before = deployment_set_desired_replicas(deployment=deployment, desired_replicas=desired, now=now)
    stored = _stored(deployment)
    assert (before, stored.desired_replicas, stored.scaled_at) == (2, desired, now)


@pytest.mark.django_db
@pytest.mark.parametrize("desired, fix", [(0, "lower Min replicas"), (5, "raise Max replicas")])
def test_a_count_outside_the_bounds_is_refused_naming_the_limit_to_change_and_nothing_changes(desired, fix):
    earlier = timezone.now() - timedelta(hours=1)
    deployment = DeploymentFactory(desired_replicas=2, min_replicas=1, max_replicas=4, scaled_at=earlier)
    with pytest.raises(ValidationError) as refused:
        deployment_set_desired_replicas(deployment=deployment, desired_replicas=desired, now=timezone.now())
    assert refused.value.message_dict == {
        "desired_replicas": [f"This deployment allows 1 to 4 replicas; {fix} to scale to {desired}."]
    }
    assert (deployment.desired_replicas, deployment.scaled_at) == (2, earlier)
    assert (_stored(deployment).desired_replicas, _stored(deployment).scaled_at) == (2, earlier)


@pytest.mark.django_db
@pytest.mark.parametrize("desired", [True, 1.0, "2", None])
def test_a_count_that_is_not_a_whole_number_is_refused(desired):
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=4)
    with pytest.raises(ValidationError) as refused:
        deployment_set_desired_replicas(deployment=deployment, desired_replicas=desired, now=timezone.now())
    assert refused.value.message_dict == {"desired_replicas": [f"Must be a whole number, not {desired!r}."]}
    assert _stored(deployment).desired_replicas == 1


@pytest.mark.django_db
def test_a_caller_words_the_refusal_and_names_its_field():
    deployment = DeploymentFactory(desired_replicas=2, min_replicas=0, max_replicas=2)
    with pytest.raises(ValidationError) as refused:
        deployment_set_desired_replicas(
            deployment=deployment,
            desired_replicas=3,
            now=timezone.now(),
            field="deployment",
            refusal="Already at its max; raise it first.",
        )
    assert refused.value.message_dict == {"deployment": ["Already at its max; raise it first."]}


@pytest.mark.django_db
def test_without_save_the_caller_saves_the_count_with_its_other_changes():
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=2)
    deployment.max_replicas = 6  # an edit of the bounds, not yet saved: the count is checked against it
    deployment_set_desired_replicas(deployment=deployment, desired_replicas=5, now=timezone.now(), save=False)
    assert _stored(deployment).desired_replicas == 1
    deployment.save()
    assert (_stored(deployment).desired_replicas, _stored(deployment).max_replicas) == (5, 6)


@pytest.mark.django_db
def test_every_caller_keeps_the_count_within_the_bounds():
    """Each way of changing the count stops at the same bounds, in its own words."""
    deployment = DeploymentFactory(desired_replicas=2, min_replicas=1, max_replicas=2)
    gpu = GpuFactory(memory_total_bytes=80 * 1024**3)
    with pytest.raises(ValidationError, match="raise Max replicas to scale to 3"):
        deployment_scale(deployment=deployment, desired_replicas=3)
    with pytest.raises(ValidationError, match="Desired replicas must lie between min"):
        deployment_update(deployment=deployment, desired_replicas=3, min_replicas=1, max_replicas=2, keep_warm=False)
    with pytest.raises(ValidationError, match=r"already wants 2 replicas, its max_replicas \(2\)"):
        replica_load_on(deployment=deployment, worker=gpu.worker, gpu=gpu)
    deployment_scale(deployment=deployment, desired_replicas=1)
    replica = ReplicaFactory(deployment=deployment, worker=gpu.worker, gpu=gpu, state=Replica.State.PENDING)
    with pytest.raises(ValidationError, match=r"must keep at least 1 replicas \(min_replicas\)"):
        replica_unload(replica=replica)
    assert _stored(deployment).desired_replicas == 1
