"""The gateway's pure rule for whether a replica can be started for a waiting request."""

import pytest

from controlplane.gateway.selectors import cold_start_refusal

GB = 1024**3


@pytest.mark.parametrize(("max_replicas", "largest", "reason"), [
    (None, 80 * GB, "it has no deployment"),
    (0, 80 * GB, "its deployment allows no replicas (max_replicas is 0)"),
    (2, None, "no worker is online"),
    (2, 4 * GB, "it needs 8.0 GiB and no online worker has that much GPU memory (or, CPU-only, memory): "
                "the largest has 4.0 GiB"),
    (1, 8 * GB, ""),  # exactly as large: it fits
    (1, 141 * GB, ""),
])
def test_cold_start_refusal(max_replicas, largest, reason):
    assert cold_start_refusal(need_bytes=8 * GB, max_replicas=max_replicas, largest_slot_bytes=largest) == reason
