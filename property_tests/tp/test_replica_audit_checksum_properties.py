"""The audit's checksums (of each tensor's bits, per row of words) change
when any one bit of a tensor changes, whatever its dtype (fp32, bf16, fp64,
int64, bool) and length (one row of words or several), and equal copies get
equal checksums."""

from __future__ import annotations

import torch
from audit_checksums import per_tensor
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptx.tp._audit import _ROW_WORDS


@settings(max_examples=200, deadline=None)
@given(
    numel=st.integers(1, 3 * _ROW_WORDS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool]),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_one_changed_element_always_changes_its_tensors_checksums(
    numel: int, dtype: torch.dtype, seed: int, data: st.DataObject
) -> None:
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(numel, generator=g) * 100).to(dtype) if dtype != torch.bool else torch.rand(numel, generator=g) > 0.5
    changed = base.clone()
    i = data.draw(st.integers(0, numel - 1))
    words = changed.view(torch.uint8)
    byte = data.draw(st.integers(0, changed.element_size() - 1))
    if dtype == torch.bool:
        changed[i] = ~changed[i]
    else:
        words[i * changed.element_size() + byte] ^= 1 << data.draw(st.integers(0, 7))
    a, b, c = per_tensor([base, base.clone(), changed])
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
