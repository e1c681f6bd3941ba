"""What the worker's perplexity check (python -m gpuworker.quality) reports and the control plane
records in the catalog: one JSON object, built by the worker with `to_json()` and read back with
`parse_perplexity_report`, where a bad field raises ContractError naming it. A measurement the
control plane asked for (the MeasureQuality task) is reported as it goes with a QualityProgress."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from gpuworker.contract.heartbeat import ContractError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PerplexityReport:
    # exp(mean negative log-likelihood per scored token) over the evaluation text.
    perplexity: float
    # Tokens whose log-probability was scored, and the window they were scored in (each window's
    # first token is context only). Figures compare only at equal text, window and tokens.
    tokens: int
    window: int
    # SHA-256 of the evaluation text's bytes (gpuworker/quality/eval_text.txt).
    text_sha256: str
    # How the weights were run: the checkpoint's quantization label or "fp8" asked for at load; "" float.
    quantization: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_perplexity_report(data: Any) -> PerplexityReport:
    if not isinstance(data, dict):
        raise ContractError("report", f"Must be an object, got {type(data).__name__}.")
    perplexity = data.get("perplexity")
    if isinstance(perplexity, bool) or not isinstance(perplexity, (int, float)) or not math.isfinite(perplexity):
        raise ContractError("perplexity", f"Must be a finite number, got {perplexity!r}.")
    if perplexity < 1:
        raise ContractError("perplexity", f"Must be at least 1, got {perplexity!r}.")
    for name in ("tokens", "window"):
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ContractError(name, f"Must be a positive integer, got {value!r}.")
    sha = data.get("text_sha256")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise ContractError("text_sha256", f"Must be 64 lowercase hex digits, got {sha!r}.")
    quantization = data.get("quantization", "")
    if not isinstance(quantization, str) or len(quantization) > 20:
        raise ContractError("quantization", f"Must be a label of at most 20 characters, got {quantization!r}.")
    return PerplexityReport(
        perplexity=float(perplexity),
        tokens=data["tokens"],
        window=data["window"],
        text_sha256=sha,
        quantization=quantization,
    )


# A measurement's states as the daemon reports them: started, then measured or failed.
RUNNING, DONE, FAILED = "running", "done", "failed"
MAX_ERROR_CHARS = 4000


@dataclass(frozen=True)
class QualityProgress:
    """POSTed to /internal/workers/<id>/quality/<measurement id>: the report with DONE, why with FAILED."""

    state: str
    report: PerplexityReport | None = None
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"state": self.state}
        if self.report is not None:
            body["report"] = self.report.to_json()
        if self.error:
            body["error"] = self.error
        return body


def parse_quality_progress(data: Any) -> QualityProgress:
    if not isinstance(data, dict):
        raise ContractError("body", f"Must be an object, got {type(data).__name__}.")
    state = data.get("state")
    if state not in (RUNNING, DONE, FAILED):
        raise ContractError("state", f"Must be one of {RUNNING}, {DONE}, {FAILED}; got {state!r}.")
    if state == DONE:
        return QualityProgress(state=DONE, report=parse_perplexity_report(data.get("report")))
    error = data.get("error", "")
    if state == FAILED and (not isinstance(error, str) or not error.strip()):
        raise ContractError("error", f"A failed measurement must say why, got {error!r}.")
    return QualityProgress(state=state, error=error[-MAX_ERROR_CHARS:] if state == FAILED else "")
