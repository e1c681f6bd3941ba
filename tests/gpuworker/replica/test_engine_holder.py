"""The replica's per-tenant shares of its recent service, as its heartbeat reports them."""

from gpuworker.contract.heartbeat import MAX_TENANT_SHARES
from gpuworker.replica.engine_holder import tenant_shares


def test_shares_are_of_the_service_between_two_readings_busiest_first():
    before = {"a": 100.0, "b": 50.0}
    after = {"a": 130.0, "b": 140.0, "": 30.0}
    assert tenant_shares(before, after) == {"b": 0.6, "a": 0.2, "": 0.2}
    assert list(tenant_shares(before, after)) == ["b", "a", ""]


def test_no_service_no_shares_and_a_restarted_engine_counts_only_growth():
    assert tenant_shares({"a": 5.0}, {"a": 5.0}) == {}
    assert tenant_shares({"a": 500.0, "b": 10.0}, {"a": 3.0, "b": 13.0}) == {"b": 1.0}


def test_only_the_busiest_tenants_are_reported():
    after = {str(i): float(i + 1) for i in range(40)}
    shares = tenant_shares({}, after)
    assert len(shares) == MAX_TENANT_SHARES and "39" in shares and "0" not in shares
