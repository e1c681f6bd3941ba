"""factory-boy factories for the control plane's models (test set-up only; services are tested
through their own calls), and usage records made the way production makes them."""

import uuid
from datetime import datetime, timedelta
from decimal import Decimal

import factory
from django.utils import timezone

from controlplane.accounts.keys import generate_api_key, hash_api_key, visible_prefix
from controlplane.accounts.models import ApiKey, Tenant, User
from controlplane.billing.holds import HoldRequest, RequestOutcome, credit_holds_place, credit_holds_settle
from controlplane.billing.models import CreditHold, Plan, PriceTier, UsageRecord
from controlplane.catalog.models import Deployment, Model
from controlplane.fleet.models import Gpu, Replica, Worker


class PriceTierFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = PriceTier

    name = factory.Sequence(lambda n: f"tier-{n}")
    price_per_request = Decimal("0.002")
    reference_price_per_million_tokens = Decimal("0.50")


class PlanFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Plan

    name = factory.Sequence(lambda n: f"plan-{n}")
    included_requests_per_month = 0
    rate_limit_per_minute = 60


class TenantFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tenant

    name = factory.Sequence(lambda n: f"Tenant {n}")
    plan = None


PASSWORD = "correct horse battery staple"


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User

    username = factory.Sequence(lambda n: f"user{n}")
    role = User.Role.TENANT_MEMBER
    tenant = factory.SubFactory(TenantFactory)
    password = factory.django.Password(PASSWORD)


class ApiKeyFactory(factory.django.DjangoModelFactory):
    """An API key; its plaintext is left on the instance as `plaintext` for tests to present."""

    class Meta:
        model = ApiKey

    plaintext = factory.LazyFunction(generate_api_key)
    tenant = factory.SubFactory(TenantFactory)
    name = factory.Sequence(lambda n: f"key-{n}")
    prefix = factory.LazyAttribute(lambda o: visible_prefix(o.plaintext))
    key_hash = factory.LazyAttribute(lambda o: hash_api_key(o.plaintext))

    @classmethod
    def _create(cls, model_class, *args, plaintext: str, **kwargs):
        api_key = super()._create(model_class, *args, **kwargs)
        api_key.plaintext = plaintext
        return api_key


class ModelFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Model

    public_name = factory.Sequence(lambda n: f"model-{n}")
    family = "llama"
    kind = Model.Kind.CHAT
    weights_path = factory.LazyAttribute(lambda o: f"/models/{o.public_name}")
    context_length = 4096
    parameter_count = 1_000_000
    gpu_memory_bytes = 2_400_000
    price_tier = factory.SubFactory(PriceTierFactory)


class DeploymentFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Deployment

    model = factory.SubFactory(ModelFactory)
    desired_replicas = 1
    min_replicas = 0
    max_replicas = 2
    # Tests scale by hand unless they say otherwise: a running beat must not move their counts.
    autoscale = False


class WorkerFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Worker

    name = factory.Sequence(lambda n: f"gpu-host-{n}")
    queue_name = factory.LazyAttribute(lambda o: f"gpuworker.{o.name}")
    advertise_host = "127.0.0.1"
    device = Worker.Device.CUDA
    cpu_memory_total_bytes = 64 * 1024**3
    cpu_cores = 16
    state = Worker.State.ONLINE
    state_changed_at = factory.LazyFunction(timezone.now)


class GpuFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Gpu

    worker = factory.SubFactory(WorkerFactory)
    index = factory.Sequence(lambda n: n % 8)
    name = "NVIDIA H200"
    memory_total_bytes = 141 * 1024**3


class ReplicaFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Replica

    deployment = factory.SubFactory(DeploymentFactory)
    worker = factory.SubFactory(WorkerFactory)
    gpu = None
    state = Replica.State.PENDING


def usage_record_settled(
    *,
    tenant: Tenant,
    model: Model,
    at: datetime | None = None,
    status: str = UsageRecord.Status.COMPLETED,
    prompt_tokens: int = 10,
    completion_tokens: int = 5,
    cached_prompt_tokens: int = 0,
    time_to_first_token_ms: int | None = 10,
    total_latency_ms: int = 100,
    num_requests: int = 1,
    api_key: ApiKey | None = None,
    replica: Replica | None = None,
    gpu_time_s: float | None = None,
    request_id: str | None = None,
    error_code: str = "",
    image_count: int = 0,
) -> UsageRecord:
    """One finished request's usage record, written as the gateway writes it: a credit hold placed
    at `at`, then settled with the request's outcome. So, as for a real request, the tenant needs
    credit (or plan allowance) to cover the price, even for a request that ends failed."""
    at = at or timezone.now()
    request_id = request_id or f"req-{uuid.uuid4().hex}"
    # The hold's expiry is wall-clock time: a running gateway's sweeper must not take it first.
    (hold,) = credit_holds_place(
        requests=[HoldRequest(request_id, tenant.pk, model.pk, api_key.pk if api_key else None, num_requests)],
        at=at,
        expires_at=timezone.now() + timedelta(minutes=10),
    )
    if not isinstance(hold, CreditHold):
        raise ValueError(f"The hold for {request_id} was refused: give tenant {tenant} credit to cover it first.")
    (settled,) = credit_holds_settle(
        outcomes=[
            RequestOutcome(
                request_id,
                status,
                prompt_tokens=prompt_tokens,
                cached_prompt_tokens=cached_prompt_tokens,
                completion_tokens=completion_tokens,
                time_to_first_token_ms=time_to_first_token_ms,
                total_latency_ms=total_latency_ms,
                gpu_time_s=gpu_time_s,
                replica_id=replica.pk if replica else None,
                error_code=error_code,
                image_count=image_count,
            )
        ],
        at=at,
    )
    if not settled.found:
        raise ValueError(f"The hold for {request_id} was settled by someone else (the sweeper?) first.")
    return UsageRecord.objects.get(pk=settled.record.pk)
