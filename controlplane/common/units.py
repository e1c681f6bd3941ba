"""Quantities written for people: the one place bytes become "19.0 GiB"."""

_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def human_bytes(n: int | float) -> str:
    """`n` bytes in the largest binary unit that keeps the figure at 1 or more, with one decimal:
    19.0 GiB, 9.2 MiB; below a KiB, whole bytes. Negative amounts (an overcommitted GPU) keep
    their sign."""
    sign, size = ("-" if n < 0 else ""), abs(n)
    for unit, scale in _UNITS:
        if size >= scale:
            return f"{sign}{size / scale:.1f} {unit}"
    return f"{sign}{size:.0f} B"
