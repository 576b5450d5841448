"""Gradient chunking: bounded communication buffers, in order."""

from __future__ import annotations

import pytest
import torch

from fsdptx import DEFAULT_MAX_BUFFER_BYTES, gradient_chunks


def chunk_bytes(chunk: list[torch.Tensor]) -> int:
    """Communication budget of a chunk: low-precision floats cost 4 bytes."""
    return sum(t.numel() * (4 if t.dtype in (torch.bfloat16, torch.float16) else t.element_size()) for t in chunk)


def test_default_budget_is_256_mib() -> None:
    assert DEFAULT_MAX_BUFFER_BYTES == 256 * 2**20


def test_everything_fitting_one_budget_is_one_chunk_of_the_same_objects() -> None:
    tensors = [torch.zeros(3), torch.zeros(2, 2), torch.zeros(1, dtype=torch.float64)]

    chunks = list(gradient_chunks(tensors, max_bytes=1024))

    assert len(chunks) == 1
    assert len(chunks[0]) == 3
    assert all(piece is original for piece, original in zip(chunks[0], tensors))


def test_tensors_that_fit_are_packed_greedily_in_order() -> None:
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(4)

    chunks = list(gradient_chunks([a, b, c], max_bytes=16))

    assert len(chunks) == 2
    assert chunks[0][0] is a and chunks[0][1] is b
    assert chunks[1][0] is c


def test_bf16_is_budgeted_at_four_bytes_per_element() -> None:
    t = torch.zeros(4, dtype=torch.bfloat16)  # 8 bytes stored, 16 communicated

    assert [len(c) for c in gradient_chunks([t], max_bytes=16)] == [1]
    assert [c[0].numel() for c in gradient_chunks([t], max_bytes=8)] == [2, 2]


def test_fp16_is_budgeted_at_four_bytes_per_element() -> None:
    t = torch.zeros(4, dtype=torch.float16)

    assert [c[0].numel() for c in gradient_chunks([t], max_bytes=8)] == [2, 2]


def test_tensor_larger_than_the_budget_is_cut_into_flat_views() -> None:
    t = torch.arange(10, dtype=torch.float32).reshape(2, 5)

    chunks = list(gradient_chunks([t], max_bytes=16))

    assert [[p.numel() for p in c] for c in chunks] == [[4], [4], [2]]
    assert all(p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for c in chunks for p in c)
    assert torch.equal(torch.cat([p for c in chunks for p in c]), t.reshape(-1))


def test_writing_into_the_views_writes_into_the_original() -> None:
    t = torch.zeros(2, 5)

    for chunk in gradient_chunks([t], max_bytes=12):
        for piece in chunk:
            piece.fill_(7.0)

    assert torch.equal(t, torch.full((2, 5), 7.0))


def test_cut_tensor_fills_the_current_chunk_and_continues_in_the_next() -> None:
    head, big = torch.zeros(1), torch.arange(6, dtype=torch.float32)

    chunks = list(gradient_chunks([head, big], max_bytes=16))

    assert chunks[0][0] is head
    assert [[p.numel() for p in c] for c in chunks] == [[1, 3], [3]]
    assert chunks[0][1].tolist() == [0.0, 1.0, 2.0]
    assert chunks[1][0].tolist() == [3.0, 4.0, 5.0]


def test_every_chunk_but_the_last_is_full() -> None:
    tensors = [torch.zeros(n) for n in (3, 5, 7, 2, 9)]

    chunks = list(gradient_chunks(tensors, max_bytes=24))

    assert [chunk_bytes(c) for c in chunks[:-1]] == [24] * (len(chunks) - 1)
    assert 0 < chunk_bytes(chunks[-1]) <= 24
    assert len(chunks) == 5  # ceil(26 elements * 4 bytes / 24)


def test_no_chunk_exceeds_the_budget_when_the_budget_is_not_a_multiple_of_the_itemsize() -> None:
    chunks = list(gradient_chunks([torch.zeros(5)], max_bytes=10))

    assert [chunk_bytes(c) for c in chunks] == [8, 8, 4]


def test_tensor_after_an_exactly_full_chunk_starts_the_next_chunk_whole() -> None:
    full, nxt = torch.zeros(4), torch.zeros(4)

    chunks = list(gradient_chunks([full, nxt], max_bytes=16))

    assert len(chunks) == 2
    assert chunks[1][0] is nxt


def test_non_contiguous_tensor_fitting_a_fresh_chunk_is_not_refused() -> None:
    full, transposed = torch.zeros(4), torch.zeros(2, 2).t()
    assert not transposed.is_contiguous()

    chunks = list(gradient_chunks([full, transposed], max_bytes=16))

    assert chunks[1] == [transposed] and chunks[1][0] is transposed


def test_non_contiguous_tensor_fitting_the_room_left_is_yielded_whole() -> None:
    transposed = torch.zeros(2, 3).t()

    chunks = list(gradient_chunks([transposed], max_bytes=1024))

    assert chunks[0][0] is transposed


def test_non_contiguous_tensor_that_must_be_split_is_rejected() -> None:
    transposed = torch.zeros(4, 4).t()

    with pytest.raises(ValueError, match="not contiguous"):
        list(gradient_chunks([transposed], max_bytes=16))


@pytest.mark.parametrize("max_bytes", [0, -1])
def test_non_positive_budget_is_rejected(max_bytes: int) -> None:
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        list(gradient_chunks([torch.zeros(1)], max_bytes=max_bytes))


def test_budget_smaller_than_one_element_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot hold one"):
        list(gradient_chunks([torch.zeros(1, dtype=torch.float64)], max_bytes=4))


def test_budget_smaller_than_one_communicated_bf16_element_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot hold one"):
        list(gradient_chunks([torch.zeros(1, dtype=torch.bfloat16)], max_bytes=2))


def test_empty_input_yields_nothing() -> None:
    assert list(gradient_chunks([], max_bytes=16)) == []


def test_integer_tensors_are_budgeted_at_their_own_itemsize() -> None:
    t = torch.zeros(8, dtype=torch.int8)

    assert [[p.numel() for p in c] for c in gradient_chunks([t], max_bytes=4)] == [[4], [4]]


def test_non_contiguous_tensor_that_fits_a_fresh_chunk_is_accepted_wherever_it_comes() -> None:
    small = torch.zeros(3)
    transposed = torch.zeros(4, 4).t()  # 64 bytes, not contiguous: cannot be cut
    chunks = list(gradient_chunks([small, transposed], max_bytes=64))
    assert len(chunks) == 2
    assert chunks[0] == [small] and chunks[1][0] is transposed
