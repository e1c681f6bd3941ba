from controlplane.fleet.lost_watch import (
    CHECK_NOT_RUNNING,
    REPLICAS_ANSWER,
    WATCH_RESUMED,
    Watch,
    paused_reasons,
    watch_resume,
)


def test_a_check_within_a_lost_window_of_the_last_continues_the_watch():
    previous = Watch(since=100.0, checked_at=200.0, held={7: 150.0})
    assert watch_resume(previous, now=203.0, max_gap_s=3) == (previous, None)


def test_a_longer_gap_or_no_record_starts_the_watch_again_and_says_why():
    watch, why = watch_resume(Watch(since=100.0, checked_at=200.0, held={7: 150.0}), now=210.5, max_gap_s=3)
    assert watch == Watch(since=210.5, checked_at=210.5) and why == "no check completed for 10.5 s"
    watch, why = watch_resume(None, now=210.5, max_gap_s=3)
    assert watch == Watch(since=210.5, checked_at=210.5) and "cache holds no watch" in why


def test_the_record_round_trips_and_an_unreadable_one_is_none():
    watch = Watch(since=1.5, checked_at=2.5, held={3: 2.0})
    assert Watch.from_json(watch.to_json()) == watch
    for garbage in (None, "x", {}, {"since": "soon", "checked_at": 1}, {"since": 1, "checked_at": 2, "held": [1]}):
        assert Watch.from_json(garbage) is None


def test_paused_reasons():
    assert paused_reasons(None, now=100, lost_after_s=3) == [CHECK_NOT_RUNNING]
    assert paused_reasons(Watch(since=10, checked_at=90), now=100, lost_after_s=3) == [CHECK_NOT_RUNNING]
    assert paused_reasons(Watch(since=98, checked_at=99), now=100, lost_after_s=3) == [WATCH_RESUMED]
    assert paused_reasons(Watch(since=10, checked_at=99), now=100, lost_after_s=3) == []
    assert paused_reasons(Watch(since=10, checked_at=99, held={4: 95}), now=100, lost_after_s=3) == [REPLICAS_ANSWER]
