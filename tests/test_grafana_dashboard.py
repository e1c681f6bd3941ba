"""docs/grafana/gpuserve.json is a Grafana dashboard whose every query names metrics that exist:
the control plane's (/metrics) and the replicas' (vLLM's names), so a renamed metric fails here."""

import json
import re
from pathlib import Path

import pytest

from controlplane.fleet.metrics import FleetCollector
from controlplane.gateway import metrics as gateway_metrics
from gpuworker.replica.metrics import EngineMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "gpuserve.json"
METRIC_NAME = re.compile(r"\b(?:gpuserve_|vllm:)[a-zA-Z0-9_:]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def _series_names(registry_like) -> set[str]:
    """The sample names the collector exposes, by its families' types (whether or not any sample
    has been recorded yet)."""
    return {family.name + suffix for family in registry_like.collect() for suffix in SUFFIXES[family.type]}


def _queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", ())]


@pytest.mark.django_db
def test_every_metric_the_dashboard_queries_is_exposed():
    exposed = (
        _series_names(gateway_metrics.REGISTRY)
        | _series_names(FleetCollector())
        | _series_names(EngineMetrics("m").registry)
    )
    named = {name for query in _queries() for name in METRIC_NAME.findall(query)}
    assert named - exposed == set()
    # It shows both sides: the control plane's figures and the replicas'.
    assert any(name.startswith("gpuserve_") for name in named) and any(name.startswith("vllm:") for name in named)


def test_the_dashboard_is_importable_json_with_unique_panel_ids():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "gpuserve"
    assert all(query.count("(") == query.count(")") for query in _queries())
