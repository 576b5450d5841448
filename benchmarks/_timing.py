"""Timing shared by the benchmark scripts (run as ``python benchmarks/X.py``,
so this directory is on ``sys.path``)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable


def seconds(fn: Callable[[], object], *, collect_first: bool = False) -> float:
    """Wall time of one ``fn()`` with the garbage collector paused, as
    ``timeit`` does: a collection landing inside one run would make it an
    outlier. ``collect_first`` empties the heap of earlier runs' garbage."""
    if collect_first:
        gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()
