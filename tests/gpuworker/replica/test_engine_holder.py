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


def test_the_reported_prefill_rate_is_not_lowered_by_idle_time():
    """Window rates: output tokens over the clock, prompt tokens over the prefilling steps' time.
    A replica that prefilled 3,000 tokens in 1 s of steps, then idled 9 s, drains a queue at
    3,000 tokens/s, not 300 (which would make the gateway predict waits ten times too long)."""
    from gpuworker.replica.engine_holder import TokenSnapshot, window_rates

    window = [TokenSnapshot(100.0, 0, 0, 0.0), TokenSnapshot(110.0, 500, 3000, 1.0)]
    generated_per_s, prefill_per_s = window_rates(window)
    assert generated_per_s == 50.0 and prefill_per_s == 3000.0
    # Nothing prefilled in the window: no evidence of a rate (the gateway then predicts no wait).
    assert window_rates([TokenSnapshot(0.0, 0, 7, 2.0), TokenSnapshot(5.0, 40, 7, 2.0)]) == (8.0, 0.0)
