"""The fleet page's figures and sparklines, from heartbeat data alone (no database)."""

from controlplane.dashboard.ops.overview import (
    HISTORY_POINTS,
    SPARK_HEIGHT,
    SPARK_WIDTH,
    FigureHistory,
    figure_views,
    loading_progress,
    sparkline_points,
)


def _xy(points: str) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in points.split()]


def test_percentages_use_a_fixed_scale_newest_at_the_right():
    points = _xy(sparkline_points([0.0, 50.0, 100.0], fixed_range=(0.0, 100.0)))
    assert [round(x, 1) for x, _ in points][-1] == SPARK_WIDTH
    assert points[0][1] == SPARK_HEIGHT - 1 and points[2][1] == 1.0  # bottom and top of the box
    assert points[1][1] == (points[0][1] + points[2][1]) / 2


def test_other_figures_scale_to_their_own_range_and_one_reading_still_draws():
    assert [y for _, y in _xy(sparkline_points([300.0, 400.0]))] == [SPARK_HEIGHT - 1, 1.0]
    single = _xy(sparkline_points([42.0]))
    assert len(single) == 2 and single[0][1] == single[1][1]
    assert sparkline_points([]) == ""


def test_history_keeps_the_last_minute_per_worker_slot_and_figure():
    history = FigureHistory()
    for i in range(HISTORY_POINTS + 5):
        history.record(
            {
                "worker_id": 7,
                "gpus": [{"index": 0, "utilization_pct": float(i), "memory_used_bytes": 1, "memory_total_bytes": 4}],
                "cpu": {"utilization_pct": 3.0},
            }
        )
    assert history.series(7, "gpu0", "utilization") == [float(i) for i in range(5, HISTORY_POINTS + 5)]
    assert history.series(7, "gpu0", "memory")[-1] == 25.0
    assert history.series(7, "cpu", "utilization")[-1] == 3.0
    assert history.series(7, "gpu0", "power") == []  # never reported
    assert history.series(8, "gpu0", "utilization") == []


def test_figure_texts_and_missing_figures():
    views = {
        v.name: v
        for v in figure_views(
            {"utilization_pct": 99.6, "memory_used_bytes": 3 * 1024**3, "memory_total_bytes": 12 * 1024**3}
        )
    }
    assert (views["utilization"].text, views["memory"].text) == ("100%", "3.0 / 12.0 GiB")
    assert (views["power"].text, views["power"].available, views["power"].points) == ("—", False, "")


def test_loading_progress_lists_only_loading_replicas():
    live = {
        "replicas": {"3": {"state": "loading", "load_progress": 0.25}, "4": {"state": "ready", "load_progress": 1.0}}
    }
    assert loading_progress(live) == [(3, 0.25)]


def test_the_heartbeat_fragment_shows_what_the_worker_stages():
    from controlplane.dashboard.ops.fragments import heartbeat_fragment
    from controlplane.dashboard.ops.overview import FigureHistory

    live = {
        "worker_id": 3,
        "staging": {
            "budget_bytes": 32 * 10**9,
            "models": [
                {"path": "/models/llama-3-8b", "bytes": 16 * 10**9, "how": "page_cache", "resident_fraction": 0.5}
            ],
        },
    }
    html = heartbeat_fragment(live, FigureHistory(), {})
    assert 'id="worker-3-staged"' in html
    assert "llama-3-8b · 14.9\xa0GB · page_cache · 50% resident" in html
    assert "No weight staging" in heartbeat_fragment({"worker_id": 3}, FigureHistory(), {})
