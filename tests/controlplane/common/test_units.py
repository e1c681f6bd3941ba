import pytest

from controlplane.common.units import human_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1000, "1000 B"),
        (1024, "1.0 KiB"),
        (9_600_000, "9.2 MiB"),
        (19 * 1024**3, "19.0 GiB"),
        (140 * 1024**3, "140.0 GiB"),
        (int(2.15 * 1024**3), "2.1 GiB"),
        (3 * 1024**4, "3.0 TiB"),
        (-2 * 1024**3, "-2.0 GiB"),
    ],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text
