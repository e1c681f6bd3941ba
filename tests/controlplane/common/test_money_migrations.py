"""Upgrading to money in micro-units keeps every amount already stored, exactly: on PostgreSQL
(NUMERIC columns, and the ledger's append-only trigger) and on SQLite, whose decimal columns held
floats that the old code's arithmetic had left a little off (a drained account read 1e-17)."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.models import Sum

from controlplane.accounts.models import ApiKey
from controlplane.billing.models import CreditAccount, CreditEntry, CreditHold, KeySpend, PriceTier, UsageRecord
from tests.controlplane.sqlite_process import run_on_sqlite

BEFORE = [("accounts", "0007_apikey_monthly_spend_limit"), ("billing", "0005_usagerecord_error_code_keyspend")]
AT = datetime(2026, 3, 2, 12, tzinfo=UTC)
LIMIT = "123456789.123456"  # 15 significant digits: as many as SQLite's floats kept

EXPECTED = {
    "tier": ["0.333333", "1.234567"],
    "limits": [LIMIT, None],
    "ledger": ["0.100000", "0.100000", "0.100000", "0.300000", "1000.000001"],
    "ledger_sum": "1000.000001",
    "drained_sum": "0.000000",
    "account": ["999.666668", "0.000000"],
    "hold": "0.002000",
    "usage": ["0.333333", "0.000022"],
    "spent": "0.333333",
    "stored": ["999666668", "0"],
}


def _targets(executor: MigrationExecutor, *, before: bool) -> list[tuple[str, str | None]]:
    """Every app's latest migration; when `before`, billing and accounts at BEFORE and every other
    app at its latest migration that needs nothing of theirs after BEFORE (none at all: unapplied)."""
    graph = executor.loader.graph
    leaves = graph.leaf_nodes()
    if not before:
        return leaves
    allowed = {node for target in BEFORE for node in graph.forwards_plan(target)}
    held = dict(BEFORE)

    def fits(node) -> bool:
        return all(dep in allowed for dep in graph.forwards_plan(node) if dep[0] in held)

    targets = list(BEFORE)
    for app, _ in leaves:
        if app in held:
            continue
        nodes = [node for node in graph.forwards_plan((app, dict(leaves)[app])) if node[0] == app]
        fitting = [node for node in nodes if fits(node)]
        targets.append(fitting[-1] if fitting else (app, None))
    return targets


def _migrate(*, before: bool):
    executor = MigrationExecutor(connection)
    targets = _targets(executor, before=before)
    executor.migrate(targets)
    executor.loader.build_graph()
    return executor.loader.project_state([target for target in targets if target[1] is not None]).apps


def _write_before(apps) -> None:
    """Rows as the code before micro-units wrote them, drift included: its plain SQL moved the
    held amount and the balance by adding and subtracting."""
    tier = apps.get_model("billing", "PriceTier").objects.create(
        name="odd", price_per_request=Decimal("0.333333"), reference_price_per_million_tokens=Decimal("1.234567")
    )
    tenant, drained = (apps.get_model("accounts", "Tenant").objects.create(name=name) for name in ("t", "drained"))
    model = apps.get_model("catalog", "Model").objects.create(
        public_name="m",
        family="llama",
        weights_path="/m",
        context_length=1,
        parameter_count=1,
        gpu_memory_bytes=1,
        price_tier=tier,
    )
    keys = apps.get_model("accounts", "ApiKey").objects
    key = keys.create(tenant=tenant, name="limited", prefix="a", key_hash="a", monthly_spend_limit=Decimal(LIMIT))
    keys.create(tenant=tenant, name="free", prefix="b", key_hash="b")
    entries = apps.get_model("billing", "CreditEntry").objects
    entries.create(tenant=tenant, kind="grant", amount=Decimal("1000.000001"))
    entries.create(tenant=drained, kind="grant", amount=Decimal("0.3"))
    for _ in range(3):
        entries.create(tenant=drained, kind="debit", amount=Decimal("-0.1"))
    apps.get_model("billing", "CreditAccount").objects.create(tenant=tenant, balance=Decimal("1000.000001"))
    with connection.cursor() as cursor:
        table = CreditAccount._meta.db_table
        cursor.execute(
            f"UPDATE {table} SET balance = balance - %s WHERE tenant_id = %s", [Decimal("0.333333"), tenant.pk]
        )
        for change in ("0.1", "0.1", "0.1", "-0.3"):
            cursor.execute(f"UPDATE {table} SET held = held + %s WHERE tenant_id = %s", [Decimal(change), tenant.pk])
    apps.get_model("billing", "CreditHold").objects.create(
        request_id="h", tenant=tenant, model=model, amount=Decimal("0.002"), expires_at=AT + timedelta(minutes=10)
    )
    apps.get_model("billing", "UsageRecord").objects.create(
        request_id="u",
        tenant=tenant,
        model=model,
        status="completed",
        prompt_tokens=7,
        completion_tokens=11,
        total_latency_ms=1,
        price_charged=Decimal("0.333333"),
        reference_price=Decimal("0.000022"),
        created_at=AT,
    )
    apps.get_model("billing", "KeySpend").objects.create(
        api_key=key, month=AT.date().replace(day=1), spent=Decimal("0.333333")
    )


def _read_after() -> dict:
    tier = PriceTier.objects.get(name="odd")
    account = CreditAccount.objects.get(tenant__name="t")
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT balance, held FROM {CreditAccount._meta.db_table} WHERE tenant_id = %s", [account.tenant_id]
        )
        stored = cursor.fetchone()
    record = UsageRecord.objects.get()
    return {
        "tier": [str(tier.price_per_request), str(tier.reference_price_per_million_tokens)],
        "limits": [
            None if key.monthly_spend_limit is None else str(key.monthly_spend_limit)
            for key in ApiKey.objects.order_by("-name")
        ],
        "ledger": sorted(str(abs(entry.amount)) for entry in CreditEntry.objects.all()),
        "ledger_sum": str(CreditEntry.objects.filter(tenant__name="t").aggregate(total=Sum("amount"))["total"]),
        "drained_sum": str(CreditEntry.objects.filter(tenant__name="drained").aggregate(total=Sum("amount"))["total"]),
        "account": [str(account.balance), str(account.held)],
        "hold": str(CreditHold.objects.get().amount),
        "usage": [str(record.price_charged), str(record.reference_price)],
        "spent": str(KeySpend.objects.get().spent),
        "stored": [repr(value) for value in stored],
    }


def upgrade_keeps_every_amount() -> dict:
    """Migrate to just before micro-units, write rows as the old code did, migrate to the end, and
    read them back through the models."""
    _write_before(_migrate(before=True))
    _migrate(before=False)
    return _read_after()


@pytest.mark.django_db(transaction=True)
def test_upgrade_and_downgrade_keep_every_amount_on_postgresql(require_postgres):
    try:
        assert upgrade_keeps_every_amount() == EXPECTED
        _migrate(before=True)
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT amount FROM {CreditEntry._meta.db_table} ORDER BY amount")
            assert [value for (value,) in cursor.fetchall()] == [Decimal("-0.1")] * 3 + [
                Decimal("0.3"),
                Decimal("1000.000001"),
            ]
            cursor.execute(f"SELECT monthly_spend_limit FROM {ApiKey._meta.db_table} ORDER BY name DESC")
            assert [value for (value,) in cursor.fetchall()] == [Decimal(LIMIT), None]
    finally:
        _migrate(before=False)


@pytest.mark.slow
def test_upgrade_keeps_every_amount_on_sqlite(tmp_path):
    assert run_on_sqlite(f"{__name__}:upgrade_keeps_every_amount", tmp_path, migrate=False) == EXPECTED
