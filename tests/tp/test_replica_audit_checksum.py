"""The audit's per-tensor checksum (of the tensor's bits) changes with every
kind of drift that a plain sum or norm of the copies misses, for small
tensors (checksummed in stacked batches) and for tensors longer than one
span of weights, and equal copies always get equal checksums."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from fsdptx.tp._audit import _CHECKSUM_SPAN, _checksums


def _swap(t: torch.Tensor, i: int, j: int) -> None:
    t[i], t[j] = t[j].clone(), t[i].clone()


def _negate_pair(t: torch.Tensor, i: int, j: int) -> None:
    t[i], t[j] = -t[i], -t[j]


def _compensate(t: torch.Tensor, i: int, j: int) -> None:
    t[i] += 0.5
    t[j] -= 0.5


DRIFTS: dict[str, Callable[[torch.Tensor, int, int], None]] = {
    "two elements swapped": _swap,
    "two elements negated": _negate_pair,
    "a compensating pair": _compensate,
}


@pytest.mark.parametrize("numel", [7, 4096, _CHECKSUM_SPAN + 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drift", sorted(DRIFTS))
def test_a_drift_that_keeps_the_sum_changes_the_checksum(numel: int, dtype: torch.dtype, drift: str) -> None:
    base = (torch.arange(numel, dtype=torch.float64) % 97 / 8).to(dtype)
    others = [torch.ones(numel, dtype=dtype) for _ in range(3)]  # batched with the tensor under test
    changed = base.clone()
    DRIFTS[drift](changed, 1, numel - 2)  # across spans for the longest tensor
    before = _checksums([base, *others], torch.device("cpu"))
    after = _checksums([changed, *others], torch.device("cpu"))
    assert before[0] != after[0]
    assert torch.equal(before[1:], after[1:])


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
    sums = _checksums([a, b, changed], torch.device("cpu"))
    assert sums[0] == sums[1]
    assert sums[2] != sums[0]


def test_an_infinity_hides_no_other_change_and_nan_copies_with_equal_bits_agree() -> None:
    a = torch.linspace(-3, 3, 1000)
    a[0] = math.inf
    a[1] = math.nan
    b = a.clone()
    b[5] += 1
    sums = _checksums([a, a.clone(), b], torch.device("cpu"))
    assert sums[0] == sums[1]
    assert sums[2] != sums[0]
