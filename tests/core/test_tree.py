"""Tree traversal: maximal uniform-dtype subtrees, dotted paths, rank-stable order."""

from __future__ import annotations

import pytest
import torch
from models import container
from torch import nn

from fsdptx import (
    get_module_from_path,
    iter_maximal_uniform_dtype_subtrees,
    iter_unique_named_buffers,
    iter_unique_named_parameters,
)

BF16 = torch.bfloat16
FP32 = torch.float32


def leaf(dtype: torch.dtype = FP32, *, buffer: torch.Tensor | None = None) -> nn.Module:
    """A module holding one parameter of ``dtype`` (and optionally one buffer)."""
    m = nn.Module()
    m.weight = nn.Parameter(torch.zeros(2, dtype=dtype))
    if buffer is not None:
        m.register_buffer("buf", buffer)
    return m


def paths(module: nn.Module, **kwargs: object) -> list[tuple[str, torch.dtype]]:
    """``(fqn, dtype)`` pairs yielded with ``return_paths=True``."""
    return [
        (fqn, dtype)
        for fqn, _m, dtype in iter_maximal_uniform_dtype_subtrees(module, return_paths=True, **kwargs)  # type: ignore[call-overload]
    ]


# --- iter_maximal_uniform_dtype_subtrees ---------------------------------------------


def test_uniform_root_yields_only_the_root() -> None:
    root = container(a=leaf(BF16), b=container(c=leaf(BF16)))

    assert list(iter_maximal_uniform_dtype_subtrees(root)) == [(root, BF16)]


def test_mixed_root_yields_its_maximal_uniform_children() -> None:
    a = container(x=leaf(BF16), y=leaf(BF16))
    b = leaf(FP32)
    root = container(a=a, b=b)

    assert list(iter_maximal_uniform_dtype_subtrees(root)) == [(a, BF16), (b, FP32)]


def test_mixed_child_is_descended_into_while_uniform_sibling_is_kept_whole() -> None:
    root = container(mixed=container(x=leaf(BF16), y=leaf(FP32)), uniform=container(z=leaf(FP32)))

    assert paths(root) == [("mixed.x", BF16), ("mixed.y", FP32), ("uniform", FP32)]


def test_subtree_without_tensors_is_ignored() -> None:
    root = container(a=leaf(BF16), empty=container(inner=nn.Module()), b=leaf(FP32))

    assert paths(root) == [("a", BF16), ("b", FP32)]


def test_tensorless_module_yields_nothing() -> None:
    assert list(iter_maximal_uniform_dtype_subtrees(container(a=nn.Module()))) == []


def test_buffers_count_towards_uniformity_by_default() -> None:
    root = container(a=leaf(BF16, buffer=torch.zeros(2, dtype=FP32)), b=leaf(BF16))

    assert paths(root) == [("b", BF16)]


def test_include_buffers_false_ignores_buffer_dtypes() -> None:
    root = container(a=leaf(BF16, buffer=torch.zeros(2, dtype=FP32)), b=leaf(BF16))

    assert paths(root, include_buffers=False) == [("", BF16)]


def test_include_buffers_false_ignores_a_subtree_holding_only_buffers() -> None:
    buffers_only = nn.Module()
    buffers_only.register_buffer("step", torch.zeros(1, dtype=torch.int64))
    root = container(a=leaf(BF16), counters=buffers_only, b=leaf(FP32))

    assert paths(root, include_buffers=False) == [("a", BF16), ("b", FP32)]
    assert paths(root, include_buffers=True) == [("a", BF16), ("counters", torch.int64), ("b", FP32)]


def test_tensor_pred_excludes_rejected_tensors_from_uniformity() -> None:
    root = container(a=leaf(BF16, buffer=torch.zeros(1, dtype=torch.int64)), b=leaf(BF16))

    assert paths(root) == [("b", BF16)]
    assert paths(root, tensor_pred=torch.is_floating_point) == [("", BF16)]


def test_mixed_direct_tensors_make_a_module_mixed_without_yielding_it() -> None:
    root = leaf(BF16, buffer=torch.zeros(1, dtype=torch.int64))

    assert paths(root) == []


def test_dtype_of_maps_tensors_before_unifying() -> None:
    root = container(a=leaf(BF16), b=leaf(FP32))

    def everything_is_fp16(_t: torch.Tensor) -> torch.dtype:
        return torch.float16

    assert paths(root, dtype_of=everything_is_fp16) == [("", torch.float16)]


def test_dtype_of_can_split_a_storage_uniform_tree() -> None:
    pinned = leaf(FP32)
    root = container(a=leaf(FP32), pinned=pinned)

    def compute(t: torch.Tensor) -> torch.dtype:
        return FP32 if t is pinned.weight else BF16

    assert paths(root, dtype_of=compute) == [("a", BF16), ("pinned", FP32)]


def test_return_paths_uses_empty_string_for_the_root() -> None:
    root = leaf(BF16)

    items = list(iter_maximal_uniform_dtype_subtrees(root, return_paths=True))

    assert items == [("", root, BF16)]


def test_return_paths_yields_dotted_fqns_of_nested_modules() -> None:
    inner = leaf(FP32)
    root = container(outer=container(mid=container(inner=inner), other=leaf(BF16)))

    items = list(iter_maximal_uniform_dtype_subtrees(root, return_paths=True))

    assert items[0] == ("outer.mid", root.outer.mid, FP32)
    assert [fqn for fqn, _m, _d in items] == ["outer.mid", "outer.other"]


def test_without_return_paths_items_are_module_dtype_pairs() -> None:
    a, b = leaf(BF16), leaf(FP32)

    assert list(iter_maximal_uniform_dtype_subtrees(container(a=a, b=b))) == [(a, BF16), (b, FP32)]


def test_order_is_registration_order_not_name_order() -> None:
    root = container(zeta=leaf(BF16), alpha=leaf(FP32), mid=leaf(BF16))

    assert [fqn for fqn, _ in paths(root)] == ["zeta", "alpha", "mid"]


def test_module_list_children_are_yielded_by_index() -> None:
    root = container(layers=nn.ModuleList([leaf(BF16), leaf(FP32)]))

    assert paths(root) == [("layers.0", BF16), ("layers.1", FP32)]


def test_module_shared_by_two_mixed_parents_is_yielded_once_under_its_first_path() -> None:
    shared = leaf(FP32)
    a = container(shared=shared, own=leaf(BF16))
    b = container(shared=shared, own=leaf(BF16))
    root = container(a=a, b=b)

    items = list(iter_maximal_uniform_dtype_subtrees(root, return_paths=True))

    assert [m for _f, m, _d in items].count(shared) == 1
    assert [(f, d) for f, _m, d in items] == [("a.shared", FP32), ("a.own", BF16), ("b.own", BF16)]


def test_module_shared_with_a_uniform_parent_is_not_yielded_inside_it() -> None:
    # ``shared`` sits inside the uniform ``a`` and inside the mixed ``b``: only
    # ``a`` may be yielded, or one yielded module would contain another.
    shared = leaf(FP32)
    a = container(shared=shared)
    b = container(shared=shared, own=leaf(BF16))

    for root, expected in (
        (container(a=a, b=b), [("a", FP32), ("b.own", BF16)]),
        (container(b=b, a=a), [("b.own", BF16), ("a", FP32)]),
    ):
        assert paths(root) == expected


def test_tied_parameter_on_two_modules_counts_for_both() -> None:
    a, b = leaf(BF16), leaf(FP32)
    b.tied = a.weight
    root = container(a=a, b=b)

    assert paths(root) == [("a", BF16)]


def test_root_is_not_mutated_by_traversal() -> None:
    root = container(a=leaf(BF16), b=leaf(FP32))
    before = [(n, t.dtype, t.data_ptr()) for n, t in root.named_parameters()]

    list(iter_maximal_uniform_dtype_subtrees(root))

    assert [(n, t.dtype, t.data_ptr()) for n, t in root.named_parameters()] == before


# --- get_module_from_path -----------------------------------------------------------


def test_empty_path_is_the_root() -> None:
    root = container(a=leaf())

    assert get_module_from_path(root, "") is root


def test_dotted_path_resolves_nested_modules() -> None:
    target = leaf()
    root = container(outer=container(inner=target))

    assert get_module_from_path(root, "outer.inner") is target


def test_module_list_index_segments_are_resolved() -> None:
    target = leaf()
    root = container(layers=nn.ModuleList([leaf(), container(attn=target)]))

    assert get_module_from_path(root, "layers.1.attn") is target


def test_unknown_segment_error_names_the_full_path_and_the_segment() -> None:
    root = container(layers=nn.ModuleList([container(attn=leaf())]))

    with pytest.raises(AttributeError) as info:
        get_module_from_path(root, "layers.0.mlp.up")

    message = str(info.value)
    assert "layers.0.mlp.up" in message
    assert "'mlp'" in message


def test_out_of_range_module_list_index_is_an_unknown_segment() -> None:
    root = container(layers=nn.ModuleList([leaf()]))

    with pytest.raises(AttributeError, match=r"'layers\.3'.*'3'"):
        get_module_from_path(root, "layers.3")


def test_parameter_name_is_not_a_module_segment() -> None:
    root = container(a=leaf())

    with pytest.raises(AttributeError, match="'weight'"):
        get_module_from_path(root, "a.weight")


# --- iter_unique_named_parameters / iter_unique_named_buffers ----------------------


def test_tied_parameter_is_yielded_once_under_its_smallest_fqn() -> None:
    head, embed = leaf(), leaf()
    head.weight = embed.weight
    root = container(head=head, embed=embed)

    items = list(iter_unique_named_parameters(root))

    assert [fqn for fqn, _ in items] == ["embed.weight"]
    assert items[0][1] is embed.weight


def test_parameters_are_sorted_by_plain_string_fqn() -> None:
    root = container(layers=nn.ModuleList([leaf() for _ in range(11)]))

    fqns = [fqn for fqn, _ in iter_unique_named_parameters(root)]

    assert fqns[:4] == ["layers.0.weight", "layers.1.weight", "layers.10.weight", "layers.2.weight"]
    assert fqns == sorted(fqns)


def test_parameter_order_ignores_registration_order() -> None:
    root = container(zeta=leaf(), alpha=leaf())

    assert [fqn for fqn, _ in iter_unique_named_parameters(root)] == ["alpha.weight", "zeta.weight"]


def test_parameters_of_multiple_parts_are_ordered_by_part_index_first() -> None:
    first = container(z=leaf())
    second = container(a=leaf())

    items = list(iter_unique_named_parameters([first, second]))

    assert [fqn for fqn, _ in items] == ["z.weight", "a.weight"]
    assert items[0][1] is first.z.weight and items[1][1] is second.a.weight


def test_parameter_shared_across_parts_is_yielded_once_in_the_first_part() -> None:
    first, second = container(z=leaf()), container(a=leaf())
    second.a.weight = first.z.weight

    assert [fqn for fqn, _ in iter_unique_named_parameters([first, second])] == ["z.weight"]


def test_a_single_module_is_accepted_as_model_parts() -> None:
    root = container(a=leaf())

    assert list(iter_unique_named_parameters(root)) == list(iter_unique_named_parameters([root]))


def test_parameters_of_a_shared_module_are_yielded_once() -> None:
    shared = leaf()
    root = container(b=container(s=shared), a=container(s=shared))

    assert [fqn for fqn, _ in iter_unique_named_parameters(root)] == ["a.s.weight"]


def test_buffers_include_non_persistent_ones() -> None:
    m = nn.Module()
    m.register_buffer("persistent", torch.zeros(1))
    m.register_buffer("scratch", torch.zeros(1), persistent=False)

    assert [fqn for fqn, _ in iter_unique_named_buffers(m)] == ["persistent", "scratch"]


def test_buffers_include_integer_ones() -> None:
    m = nn.Module()
    m.register_buffer("steps", torch.zeros(1, dtype=torch.int64))

    assert [(fqn, b.dtype) for fqn, b in iter_unique_named_buffers(m)] == [("steps", torch.int64)]


def test_shared_buffer_is_yielded_once_under_its_smallest_fqn() -> None:
    buf = torch.zeros(3)
    b, a = nn.Module(), nn.Module()
    b.register_buffer("rope", buf)
    a.register_buffer("rope", buf)
    root = container(b=b, a=a)

    items = list(iter_unique_named_buffers(root))

    assert [fqn for fqn, _ in items] == ["a.rope"]
    assert items[0][1] is buf


def test_buffers_are_sorted_by_part_then_plain_string_fqn() -> None:
    def with_buffers(*names: str) -> nn.Module:
        m = nn.Module()
        for name in names:
            m.register_buffer(name, torch.zeros(1))
        return m

    first = container(layers=nn.ModuleList([with_buffers("b") for _ in range(11)]))
    second = with_buffers("z", "a")

    fqns = [fqn for fqn, _ in iter_unique_named_buffers([first, second])]

    assert fqns[:3] == ["layers.0.b", "layers.1.b", "layers.10.b"]
    assert fqns[-2:] == ["a", "z"]
    assert len(fqns) == 13


def test_buffers_exclude_parameters_and_parameters_exclude_buffers() -> None:
    m = leaf(buffer=torch.zeros(1))

    assert [fqn for fqn, _ in iter_unique_named_parameters(m)] == ["weight"]
    assert [fqn for fqn, _ in iter_unique_named_buffers(m)] == ["buf"]
