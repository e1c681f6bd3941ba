"""Recent latency percentiles of an engine: time to first token and inter-token latency over a
sliding window, which heartbeats carry to the autoscaler (`/stats`: ttft_p95_s, itl_p95_s).

Pure Python (no torch), fed and read on the engine thread only.
"""

from __future__ import annotations

import math
import time
from collections import deque

WINDOW_S = 60.0
# Bounds memory and the cost of a percentile: at high token rates the inter-token window is the
# last MAX_SAMPLES tokens rather than the last WINDOW_S seconds.
MAX_SAMPLES = 10_000


class SlidingWindow:
    """Samples of one latency from the last `window_s` seconds, at most `max_samples` of them."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        if window_s <= 0 or max_samples < 1:
            raise ValueError(f"window_s must be > 0 and max_samples >= 1, got {window_s} and {max_samples}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (monotonic time, seconds)

    def add(self, seconds: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, seconds))

    def percentile(self, q: float, now: float | None = None) -> float | None:
        """The q-th percentile (nearest rank: a value that was observed) of the samples still in the
        window; None when there is none."""
        if not 0 < q <= 100:
            raise ValueError(f"q must be in (0, 100], got {q}")
        now = time.monotonic() if now is None else now
        samples = self._samples
        while samples and samples[0][0] <= now - self.window_s:
            samples.popleft()
        if not samples:
            return None
        values = sorted(value for _, value in samples)
        return values[math.ceil(q / 100 * len(values)) - 1]


class LatencyWindows:
    """The engine's recent latencies, one sample per event where tokens are produced: a request's
    first token (time from its arrival) and each later step that advanced it (time since the step
    before that did)."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self.time_to_first_token = SlidingWindow(window_s, max_samples)
        self.inter_token = SlidingWindow(window_s, max_samples)

    def figures(self, now: float | None = None) -> dict[str, float | None]:
        return {
            "ttft_p95_s": self.time_to_first_token.percentile(95, now),
            "itl_p95_s": self.inter_token.percentile(95, now),
        }
