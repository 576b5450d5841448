"""The audit's checksums (of each tensor's bits, per row of words) change with
every kind of drift a plain sum or norm of the copies misses, for small
tensors (stacked in batches) and for tensors of several rows, and equal
copies always get equal checksums (that any one changed bit changes them is
a property, in property_tests/tp/test_replica_audit_checksum_properties.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from audit_checksums import per_tensor

from fsdptx.tp._audit import _ROW_WORDS


def _swap(t: torch.Tensor, i: int, j: int) -> None:
    t[i], t[j] = t[j].clone(), t[i].clone()


def _negate_pair(t: torch.Tensor, i: int, j: int) -> None:
    t[i], t[j] = -t[i], -t[j]


def _compensate(t: torch.Tensor, i: int, j: int) -> None:
    t[i] += 0.5
    t[j] -= 0.5


def _shift_all(t: torch.Tensor, i: int, j: int) -> None:
    """Every element moved by the same amount (ones becoming twos changes
    each fp32 word by exactly 2**23)."""
    t += 1


DRIFTS: dict[str, Callable[[torch.Tensor, int, int], None]] = {
    "two elements swapped": _swap,
    "two elements negated": _negate_pair,
    "a compensating pair": _compensate,
    "every element shifted alike": _shift_all,
}


# Swapping two ones changes nothing, so that one pair is not a drift.
CASES = [(d, b) for d in sorted(DRIFTS) for b in ("ones", "ramp") if (d, b) != ("two elements swapped", "ones")]


@pytest.mark.parametrize("numel", [7, 4096, 2 * _ROW_WORDS + 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("drift", "base"), CASES)
def test_a_drift_that_keeps_the_sum_or_the_norm_changes_the_checksum(
    numel: int, dtype: torch.dtype, drift: str, base: str
) -> None:
    start = torch.ones(numel) if base == "ones" else torch.arange(numel, dtype=torch.float64) % 97 / 8 + 1
    start = start.to(dtype)
    others = [torch.ones(numel, dtype=dtype) for _ in range(3)]  # stacked with the tensor under test
    changed = start.clone()
    DRIFTS[drift](changed, 1, numel - 2)  # rows apart for the longest tensor
    assert not torch.equal(changed, start)
    before = per_tensor([start, *others])
    after = per_tensor([changed, *others])
    assert not torch.equal(before[0], after[0])
    assert all(torch.equal(a, b) for a, b in zip(before[1:], after[1:]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.linspace(-3, 3, 1001).bfloat16(),  # odd count of 2-byte elements
        lambda: torch.tensor([True, False, True]),
        lambda: torch.arange(5, dtype=torch.int64),
        lambda: torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).t(),  # not contiguous
        lambda: torch.randn(2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)),
    ],
)
def test_equal_copies_get_equal_checksums_and_one_changed_element_another(
    make: Callable[[], torch.Tensor],
) -> None:
    a, b = make(), make()
    changed = make()
    first = (0,) * changed.dim()
    changed[first] = ~changed[first] if changed.dtype == torch.bool else changed[first] + 1
    sums = per_tensor([a, b, changed])
    assert torch.equal(sums[0], sums[1])
    assert not torch.equal(sums[2], sums[0])


def test_an_infinity_hides_no_other_change_and_nan_copies_with_equal_bits_agree() -> None:
    a = torch.linspace(-3, 3, 1000)
    a[0] = math.inf
    a[1] = math.nan
    b = a.clone()
    b[5] += 1
    sums = per_tensor([a, a.clone(), b])
    assert torch.equal(sums[0], sums[1]) and bool(sums[0].isfinite().all())
    assert not torch.equal(sums[2], sums[0])
