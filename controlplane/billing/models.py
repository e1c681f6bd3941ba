"""Prices, plans, the append-only credit ledger, each tenant's credit account and holds, and usage.

Money is a Decimal with six decimal places (per-request prices are fractions of a cent), stored
as whole micro-units (`common.money.MoneyField`) so that sums are exact on every database.
"""

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

from controlplane.common.money import PRICE_SIGNIFICANT_DIGITS, MoneyField, format_usd


class PriceTier(models.Model):
    name = models.CharField(max_length=50, unique=True)
    price_per_request = MoneyField(validators=[MinValueValidator(0)])
    # What a per-token price list would charge, recorded beside each request so reports can show
    # how flat per-request pricing compares.
    reference_price_per_million_tokens = MoneyField(validators=[MinValueValidator(0)])
    # Offline work (the Batch API) fills idle capacity and waits its turn, so it costs less.
    batch_price_per_request = MoneyField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Price of one Batch API request; empty: half the price per request.",
    )

    class Meta:
        ordering = ["price_per_request", "name"]

    def __str__(self) -> str:
        return f"{self.name} ({format_usd(self.price_per_request, significant=PRICE_SIGNIFICANT_DIGITS)}/request)"


class Plan(models.Model):
    name = models.CharField(max_length=50, unique=True)
    included_requests_per_month = models.PositiveIntegerField(
        help_text="Requests each month that are not charged to credits."
    )
    rate_limit_per_minute = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    max_concurrent_requests = models.PositiveIntegerField(
        default=16,
        validators=[MinValueValidator(1)],
        help_text="Requests in flight at once, for the whole tenant and for each of its keys.",
    )
    fair_share_weight = models.PositiveIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text="The tenant's share of a busy GPU relative to other tenants': weight 2 is served twice "
        "as many tokens as weight 1 while both have requests waiting.",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class AppendOnlyError(Exception):
    """Raised on any attempt to change or remove a ledger entry; corrections are new entries."""


class CreditEntryQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise AppendOnlyError("Credit entries are append-only; add a correcting entry instead.")

    def delete(self):
        raise AppendOnlyError("Credit entries are append-only; add a correcting entry instead.")


class CreditEntry(models.Model):
    """One movement of a tenant's credits; the balance is the sum of the tenant's entries."""

    class Kind(models.TextChoices):
        GRANT = "grant", "Grant"
        DEBIT = "debit", "Adjustment"
        USAGE = "usage", "Usage charge"

    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.PROTECT, related_name="credit_entries")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    amount = MoneyField(help_text="Positive adds credits, negative spends them.")
    memo = models.CharField(max_length=200, blank=True)
    # At most one charge per request: the request id is unique on the usage record.
    usage_record = models.OneToOneField(
        "billing.UsageRecord", on_delete=models.PROTECT, null=True, blank=True, related_name="credit_entry"
    )
    created_by = models.ForeignKey("accounts.User", on_delete=models.PROTECT, null=True, blank=True, related_name="+")
    # The token of the form that made an entry by hand: a second submission of that form finds it.
    idempotency_token = models.UUIDField(null=True, blank=True, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    objects = CreditEntryQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "credit entries"
        constraints = [
            models.CheckConstraint(
                condition=(Q(kind="grant", amount__gt=0) | Q(kind__in=["debit", "usage"], amount__lt=0)),
                name="creditentry_sign_matches_kind",
                violation_error_message="Grants must be positive; debits and usage charges negative.",
            ),
            models.CheckConstraint(
                condition=Q(kind="usage", usage_record__isnull=False) | ~Q(kind="usage"),
                name="creditentry_usage_has_record",
                violation_error_message="A usage charge must name its usage record.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant} {self.amount:+} ({self.kind})"

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AppendOnlyError("Credit entries are append-only; add a correcting entry instead.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnlyError("Credit entries are append-only; add a correcting entry instead.")


class CreditAccount(models.Model):
    """A tenant's running balance (always the sum of its ledger entries), the credit held by its
    requests in flight, and how much of its plan's monthly allowance is used or held.

    Admission reads and updates this one row under a lock instead of summing the whole ledger.
    """

    tenant = models.OneToOneField(
        "accounts.Tenant", on_delete=models.PROTECT, primary_key=True, related_name="credit_account"
    )
    balance = MoneyField(default=Decimal("0"))
    held = MoneyField(default=Decimal("0"))
    allowance_month = models.DateField(null=True, blank=True, help_text="First day of the counted month.")
    allowance_used = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(held__gte=0),
                name="creditaccount_held_not_negative",
                violation_error_message="Held credit cannot be negative.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id}: {self.balance} ({self.held} held)"

    @property
    def available(self) -> Decimal:
        return self.balance - self.held


class CreditHold(models.Model):
    """Credit set aside for one request in flight, from admission until it is charged or released.

    A hold still here after `expires_at` belongs to a gateway that died mid-request: the sweeper
    charges it if the request had already sent its first token, and releases it otherwise.
    """

    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.PROTECT, related_name="credit_holds")
    api_key = models.ForeignKey("accounts.ApiKey", on_delete=models.PROTECT, null=True, blank=True, related_name="+")
    model = models.ForeignKey("catalog.Model", on_delete=models.PROTECT, related_name="+")
    num_requests = models.PositiveSmallIntegerField(default=1, help_text="Choices asked for (n).")
    included_requests = models.PositiveSmallIntegerField(
        default=0, help_text="How many of them the plan's monthly allowance pays for."
    )
    allowance_month = models.DateField(null=True, blank=True)
    amount = MoneyField(validators=[MinValueValidator(0)])
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(db_index=True)

    def __str__(self) -> str:
        return f"hold {self.request_id} {self.amount}"


class UsageRecord(models.Model):
    """One served (or attempted) API request, written once when the request ends."""

    class Status(models.TextChoices):
        COMPLETED = "completed", "Completed"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled by the client"

    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.PROTECT, related_name="usage_records")
    api_key = models.ForeignKey(
        "accounts.ApiKey",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="usage_records",
        help_text="Empty for requests from the dashboard playground.",
    )
    model = models.ForeignKey("catalog.Model", on_delete=models.PROTECT, related_name="usage_records")
    replica = models.ForeignKey(
        "fleet.Replica", on_delete=models.SET_NULL, null=True, blank=True, related_name="usage_records"
    )
    status = models.CharField(max_length=20, choices=Status.choices)
    error_code = models.CharField(
        max_length=40,
        blank=True,
        help_text="Why a failed request failed, as the client's error code said (replica_unavailable, timeout...).",
    )
    num_requests = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1)], help_text="Choices asked for (n): n requests' price."
    )
    prompt_tokens = models.PositiveIntegerField()
    cached_prompt_tokens = models.PositiveIntegerField(
        default=0,
        db_default=0,
        help_text="Prompt tokens served from the replica's prefix cache (either KV tier): prefill not computed.",
    )
    completion_tokens = models.PositiveIntegerField()
    image_count = models.PositiveSmallIntegerField(default=0, help_text="Images the request carried.")
    time_to_first_token_ms = models.PositiveIntegerField(
        null=True, blank=True, help_text="Empty when no token was produced (embeddings, early failures)."
    )
    total_latency_ms = models.PositiveIntegerField()
    gpu_time_s = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="The request's share of the replica's engine step time, as the worker reported it.",
    )
    batch = models.BooleanField(
        default=False, db_default=False, help_text="A line of a Batch API job, charged at the batch price."
    )
    price_charged = MoneyField(validators=[MinValueValidator(0)])
    reference_price = MoneyField(
        validators=[MinValueValidator(0)],
        help_text="This request's price at the tier's per-token reference rate.",
    )
    # When the request ended; set by the service (not auto_now_add) so monthly allowances and
    # reports use the time the gateway measured.
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "created_at"])]

    def __str__(self) -> str:
        return self.request_id

    @property
    def outcome(self) -> str:
        """How the request ended, in the request log's words: ok, client gone, or its error code."""
        if self.status == self.Status.FAILED:
            return self.error_code or "error"
        return "client gone" if self.status == self.Status.CANCELLED else "ok"

    def clean(self) -> None:
        super().clean()
        if self.api_key_id is not None and self.tenant_id is not None and self.api_key.tenant_id != self.tenant_id:
            raise ValidationError({"api_key": "The API key belongs to a different tenant."})
        if (
            self.time_to_first_token_ms is not None
            and self.total_latency_ms is not None
            and self.time_to_first_token_ms > self.total_latency_ms
        ):
            raise ValidationError({"time_to_first_token_ms": "Time to first token cannot exceed the total latency."})


class KeySpend(models.Model):
    """What one API key was charged in one calendar month (UTC), kept up to date by settlement, so
    that a key's monthly spend limit is checked against one row instead of a month of records."""

    api_key = models.ForeignKey("accounts.ApiKey", on_delete=models.CASCADE, related_name="monthly_spend")
    month = models.DateField(help_text="First day of the month.")
    spent = MoneyField(default=Decimal("0"))

    class Meta:
        constraints = [models.UniqueConstraint(fields=["api_key", "month"], name="keyspend_one_row_per_month")]

    def __str__(self) -> str:
        return f"key {self.api_key_id} {self.month:%Y-%m}: {self.spent}"


class Refusal(models.Model):
    """Requests the gateway refused (answered with an error before anything was served, never
    charged), counted: one row per kind of refusal (tenant, key, model, endpoint, status, error code) and
    gateway process in each flush interval, so that the number of rows written follows the number
    of kinds, not of requests (see gateway/refusals.py). A refusal that cannot be tied to a tenant
    (a bad key) has none: the operator counts it, no tenant sees it."""

    minute = models.DateTimeField(db_index=True, help_text="The minute the refusals happened in (UTC).")
    tenant = models.ForeignKey(
        "accounts.Tenant", on_delete=models.SET_NULL, null=True, blank=True, related_name="refusals"
    )
    api_key = models.ForeignKey("accounts.ApiKey", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    model = models.ForeignKey("catalog.Model", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    endpoint = models.CharField(
        max_length=80,
        blank=True,
        db_default="",
        default="",
        help_text='The /v1 route asked ("/v1/files/{file_id}"), as /metrics labels it; blank for no route.',
    )
    status = models.PositiveSmallIntegerField(help_text="The HTTP status the client got.")
    error_code = models.CharField(max_length=40, blank=True, help_text="The error code the client got.")
    reason = models.CharField(max_length=300, blank=True, help_text="The error message of the latest one.")
    request_id = models.CharField(max_length=64, blank=True, help_text="The latest one's request id.")
    count = models.PositiveIntegerField(validators=[MinValueValidator(1)])

    class Meta:
        ordering = ["-minute", "-id"]
        indexes = [models.Index(fields=["tenant", "minute"])]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.endpoint} {self.status} {self.error_code} x{self.count}"
