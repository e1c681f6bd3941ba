"""The perplexity report: what the worker's command prints reads back; a bad field is named."""

from __future__ import annotations

import pytest

from gpuworker.contract.heartbeat import ContractError
from gpuworker.contract.quality import PerplexityReport, parse_perplexity_report

GOOD = PerplexityReport(perplexity=24.83, tokens=510, window=256, text_sha256="ab" * 32, quantization="fp8")


def test_a_report_reads_back():
    assert parse_perplexity_report(GOOD.to_json()) == GOOD
    float_model = {k: v for k, v in GOOD.to_json().items() if k != "quantization"}
    assert parse_perplexity_report(float_model).quantization == ""


@pytest.mark.parametrize(
    "change, field",
    [
        ({"perplexity": float("nan")}, "perplexity"),
        ({"perplexity": 0.5}, "perplexity"),
        ({"perplexity": True}, "perplexity"),
        ({"tokens": 0}, "tokens"),
        ({"window": "256"}, "window"),
        ({"text_sha256": "AB" * 32}, "text_sha256"),
        ({"quantization": 8}, "quantization"),
    ],
)
def test_a_bad_field_is_named(change, field):
    with pytest.raises(ContractError) as caught:
        parse_perplexity_report({**GOOD.to_json(), **change})
    assert caught.value.field == field


def test_not_an_object():
    with pytest.raises(ContractError, match="Must be an object"):
        parse_perplexity_report([1, 2])
