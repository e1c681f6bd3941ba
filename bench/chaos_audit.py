"""The chaos suite's audit: what the clients saw (`chaos_traffic.ClientRecord`s) against the usage
records, holds and credit ledger the system wrote.

Invariants: every request id a client saw has at most one usage record and no hold left (it was
charged once, recorded unbilled, or released); a client that got a whole answer was charged (else
a lost charge); a client that got an error, before or during a stream, was not (else an
overcharge); every
charged usage record has exactly one ledger entry of its price; every tenant's balance equals the
sum of its ledger entries and is not below zero, with nothing held; every client that stayed got
a well-formed OpenAI answer or error. Records whose request id no client saw must be explained by
clients that left before the response headers (they never learnt their id). And the run itself:
every fault injected acted on something and had the effect it is there for (`chaos.Fault.problem`);
a run whose faults did nothing proves nothing about them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from decimal import Decimal

from bench.chaos_traffic import BROKEN, COMPLETED, ERROR, LEFT, STREAM_ERROR, ClientRecord


@dataclass
class Audit:
    requests: int = 0
    seen_ids: int = 0
    charged: int = 0
    recorded_unbilled: int = 0
    released: int = 0
    ledger_usage_entries: int = 0
    # client outcome -> what billing made of those requests -> how many
    ledger_by_outcome: dict[str, dict[str, int]] = field(default_factory=dict)
    lost_charges: list[str] = field(default_factory=list)
    double_charges: list[str] = field(default_factory=list)
    overcharges: list[str] = field(default_factory=list)
    duplicate_ids: list[str] = field(default_factory=list)
    unexplained_records: list[str] = field(default_factory=list)
    entries_not_matching_records: list[str] = field(default_factory=list)
    holds_left: list[str] = field(default_factory=list)
    balances_not_ledger: list[str] = field(default_factory=list)
    negative_balances: list[str] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    faults_without_effect: list[str] = field(default_factory=list)

    PROBLEMS = (
        "lost_charges",
        "double_charges",
        "overcharges",
        "duplicate_ids",
        "unexplained_records",
        "entries_not_matching_records",
        "holds_left",
        "balances_not_ledger",
        "negative_balances",
        "malformed",
        "faults_without_effect",
    )

    @property
    def ok(self) -> bool:
        return not any(getattr(self, name) for name in self.PROBLEMS)

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def audit(records: list[ClientRecord], tenant_names: list[str], fault_problems: list[str] = ()) -> Audit:
    """Read the database (Django must be set up) and check every invariant; never raises on a
    violation, it lists it. `fault_problems`: each fault that found nothing to act on or whose
    effect was never seen, described."""
    from django.db.models import Sum

    from controlplane.accounts.models import Tenant
    from controlplane.billing.models import CreditAccount, CreditEntry, CreditHold, UsageRecord

    tenants = {t.pk: t.name for t in Tenant.objects.filter(name__in=tenant_names)}
    result = Audit(requests=len(records), faults_without_effect=list(fault_problems))
    usage = {r.request_id: r for r in UsageRecord.objects.filter(tenant_id__in=tenants)}
    entries = list(
        CreditEntry.objects.filter(tenant_id__in=tenants, kind=CreditEntry.Kind.USAGE).values(
            "usage_record__request_id", "amount"
        )
    )
    result.ledger_usage_entries = len(entries)
    per_record = Counter(e["usage_record__request_id"] for e in entries)
    result.double_charges = sorted(rid for rid, n in per_record.items() if n > 1)
    for entry in entries:
        record = usage.get(entry["usage_record__request_id"])
        if record is None or entry["amount"] != -record.price_charged:
            result.entries_not_matching_records.append(f"{entry['usage_record__request_id']}: {entry['amount']}")
    for request_id, record in usage.items():
        if record.price_charged > 0 and per_record[request_id] == 0:
            result.entries_not_matching_records.append(f"{request_id}: charged {record.price_charged}, no entry")
    result.charged = sum(1 for r in usage.values() if r.price_charged > 0)

    seen = Counter(r.request_id for r in records if r.request_id)
    result.seen_ids = len(seen)
    result.duplicate_ids = sorted(rid for rid, n in seen.items() if n > 1)
    for client in records:
        record = usage.get(client.request_id) if client.request_id else None
        charged = record is not None and record.price_charged > 0
        where = f"{client.request_id} ({client.tenant}, {client.kind}, {client.plan}: {client.label})"
        if client.outcome == COMPLETED and not charged:
            result.lost_charges.append(f"{where}: record {record.status if record else 'missing'}")
        if client.outcome in (ERROR, STREAM_ERROR) and charged:
            result.overcharges.append(f"{where}: charged {record.price_charged} as {record.status}")
        if client.outcome == BROKEN or (client.outcome != LEFT and not client.well_formed):
            result.malformed.append(f"{where}")
        if client.request_id:
            fate = "released" if record is None else f"{'charged' if charged else 'unbilled'} {record.status}"
            result.released += record is None
            result.recorded_unbilled += record is not None and not charged
        else:
            fate = "id never seen"
        fates = result.ledger_by_outcome.setdefault(client.label, {})
        fates[fate] = fates.get(fate, 0) + 1
    # Requests whose client left before learning its id: at most that many records no client saw.
    anonymous = Counter(c.tenant for c in records if c.request_id is None and c.outcome == LEFT)
    unseen = Counter(tenants[r.tenant_id] for rid, r in usage.items() if rid not in seen)
    for tenant, count in unseen.items():
        if count > anonymous[tenant]:
            ids = sorted(rid for rid, r in usage.items() if rid not in seen and tenants[r.tenant_id] == tenant)
            result.unexplained_records.append(
                f"{tenant}: {count} records no client saw, {anonymous[tenant]} clients left before their id: {ids[:10]}"
            )

    result.holds_left = [
        f"{h.request_id} ({tenants.get(h.tenant_id)}, {h.amount}, expires {h.expires_at:%H:%M:%S})"
        for h in CreditHold.objects.filter(tenant_id__in=tenants)
    ]
    sums = dict(
        CreditEntry.objects.filter(tenant_id__in=tenants)
        .values("tenant_id")
        .annotate(total=Sum("amount"))
        .values_list("tenant_id", "total")
    )
    for account in CreditAccount.objects.filter(tenant_id__in=tenants):
        name, ledger = tenants[account.tenant_id], sums.get(account.tenant_id) or Decimal("0")
        if account.balance != ledger or account.held != 0:
            result.balances_not_ledger.append(
                f"{name}: balance {account.balance}, ledger {ledger}, held {account.held}"
            )
        if account.balance < 0:
            result.negative_balances.append(f"{name}: {account.balance}")
    return result
