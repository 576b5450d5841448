"""Byte sizes as people read them: the one unit convention of every report.

``str(plan)``, the CLI's text and HTML reports and the benchmarks all print
sizes through :func:`format_bytes`, so one unit of the same model reads the
same everywhere (binary units, as GPU memory is sold and as torch's memory
tools report it).
"""

from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches, two decimals.

    Args:
        n: a byte count (a float for averages and fractions of a budget);
            negative for a decrease.

    Returns:
        ``"49.00 MiB"``, ``"1.50 GiB"``; below 1 KiB whole bytes, ``"512 B"``.

    Example:
        >>> format_bytes(49 * 2**20)
        '49.00 MiB'
        >>> format_bytes(512)
        '512 B'
    """
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
