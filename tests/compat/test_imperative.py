"""The seed-compatible imperative API: fully_shard_by_dtype,
fully_shard_across_blocks, configure_fsdp_unused_param_reduction and the
MTP/CP guards."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from models import BF16, DIM, FP32, Block, CastLinear, Mlp, make_decoder, master_weights
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.compat import _imperative as imperative
from fsdptx.testing import fake_mesh, mark_sharded

BF16_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, output_dtype=BF16)
MESH = object()  # the recording primitive never looks at the mesh


class RecordingPrimitive:
    """Stands in for ``fully_shard``: records ``(modules, kwargs)`` and does nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module | list[nn.Module], dict[str, Any]]] = []

    def __call__(self, modules: nn.Module | list[nn.Module], **kwargs: Any) -> None:
        self.calls.append((modules, kwargs))

    def targets(self) -> list[nn.Module | list[nn.Module]]:
        return [m for m, _ in self.calls]


def by_dtype(
    module: nn.Module,
    mp_policy: MixedPrecisionPolicy | None = None,
    fp32_names: tuple[str, ...] = (),
    reshard: bool | int | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> RecordingPrimitive:
    prim = RecordingPrimitive()
    fsdptx.fully_shard_by_dtype(
        module, MESH, mp_policy, None, fp32_names, reshard, ignored, shard_module=prim  # type: ignore[arg-type]
    )
    return prim


class FP32Scaled(nn.Module):
    """A block whose own fp32 ``scale`` sits beside bf16 submodules, and whose
    mlp holds an fp32 ``shift`` directly beside bf16 linears."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()
        self.proj = CastLinear(DIM, DIM, BF16)
        self.scale = nn.Parameter(torch.ones(DIM, dtype=FP32))
        self.mlp.shift = nn.Parameter(torch.zeros(DIM, dtype=FP32))


class ForgetGate(nn.Module):
    """Kimi-Linear style: fp32 ``dt_bias`` and bf16 ``A_log`` directly on one
    module beside bf16 projections; no unit can hold both."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = CastLinear(DIM, DIM, BF16)
        self.dt_bias = nn.Parameter(torch.zeros(DIM, dtype=FP32))
        self.A_log = nn.Parameter(torch.zeros(DIM, dtype=BF16))


# --------------------------------------------------------------------------- fully_shard_by_dtype


def test_by_dtype_one_group_shards_the_module_once() -> None:
    mlp = Mlp()
    prim = by_dtype(mlp, BF16_POLICY)
    assert prim.targets() == [mlp]
    assert prim.calls[0][1]["mp_policy"] == BF16_POLICY


def test_by_dtype_two_groups_shard_minority_subtrees_then_the_module() -> None:
    block = Block()
    prim = by_dtype(block)
    assert prim.targets() == [block.attn.sinks, block.gate, block]


def test_by_dtype_two_groups_give_children_internal_policy_and_module_the_callers() -> None:
    # Without pinning, and recorded as computing in bf16, sinks and gate are
    # fp32 master weights (unrecorded, in this bf16-bulk block they would
    # be intrinsically fp32).
    block = master_weights(Block(), "sinks.weight", "gate.proj.weight")
    prim = by_dtype(block, BF16_POLICY)
    policies = [kw["mp_policy"] for _, kw in prim.calls]
    assert prim.targets() == [block.attn.sinks, block.gate, block]
    assert [p.output_dtype for p in policies] == [None, None, BF16]
    assert {p.param_dtype for p in policies} == {BF16}


def test_by_dtype_three_groups_shard_every_maximal_uniform_subtree() -> None:
    block = master_weights(Block(), "gate.proj.weight")
    prim = by_dtype(block, BF16_POLICY, fp32_names=("sinks",))
    assert prim.targets() == [block.attn.o, block.attn.q, block.attn.sinks, block.gate, block.mlp]  # FQN order


def test_by_dtype_pinned_fp32_unit_reduces_in_fp32_without_casting_inputs() -> None:
    block = Block()
    prim = by_dtype(block, BF16_POLICY, fp32_names=("sinks",))
    (sinks_kwargs,) = [kw for m, kw in prim.calls if m is block.attn.sinks]
    assert sinks_kwargs["mp_policy"] == MixedPrecisionPolicy(
        param_dtype=FP32, reduce_dtype=FP32, output_dtype=None, cast_forward_inputs=False
    )


def test_by_dtype_does_not_pass_reshard_after_forward_none() -> None:
    prim = by_dtype(Block())
    assert all("reshard_after_forward" not in kw for _, kw in prim.calls)


def test_by_dtype_passes_explicit_reshard_after_forward_to_every_unit() -> None:
    prim = by_dtype(Block(), reshard=False)
    assert [kw["reshard_after_forward"] for _, kw in prim.calls] == [False, False, False]


def test_by_dtype_forwards_ignored_params_only_to_units_containing_them() -> None:
    block = Block()
    prim = by_dtype(block, ignored={block.gate.proj.weight})
    with_ignored = [(m, kw["ignored_params"]) for m, kw in prim.calls if "ignored_params" in kw]
    assert prim.targets() == [block.attn.sinks, block]
    assert with_ignored == [(block, {block.gate.proj.weight})]


def test_by_dtype_keeps_the_module_as_a_unit_when_only_it_can_hold_ignored_params() -> None:
    block = Block()
    prim = by_dtype(block, BF16_POLICY, fp32_names=("sinks",), ignored={block.attn.q.weight})
    assert prim.targets()[-1] is block
    assert prim.calls[-1][1]["ignored_params"] == {block.attn.q.weight}


def test_by_dtype_ignores_ignored_params_from_outside_the_module() -> None:
    mlp, stranger = Mlp(), nn.Parameter(torch.zeros(2))
    prim = by_dtype(mlp, ignored={stranger})
    assert prim.targets() == [mlp] and "ignored_params" not in prim.calls[0][1]


def test_by_dtype_shards_children_before_modules_holding_the_minority_directly() -> None:
    block = FP32Scaled()
    prim = by_dtype(block)
    assert prim.targets() == [[block.mlp.down, block.mlp.up], block.mlp, block.proj, block]


def test_by_dtype_with_real_fully_shard_gives_direct_holders_units_of_their_own() -> None:
    block = FP32Scaled()
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.fully_shard_by_dtype(block, mesh, None, None)
        shift_group = fully_shard.state(block.mlp)._fsdp_param_group  # type: ignore[attr-defined]
        owned = [fp.sharded_param for fp in shift_group.fsdp_params]
    assert len(owned) == 1 and owned[0] is block.mlp.shift
    assert all(isinstance(p, DTensor) for p in block.parameters())


def test_by_dtype_raises_naming_every_directly_mixed_param_before_any_call() -> None:
    prim = RecordingPrimitive()
    with pytest.raises(ValueError) as info:
        fsdptx.fully_shard_by_dtype(ForgetGate(), MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    message = str(info.value)
    assert "dt_bias (float32->float32)" in message and "A_log (bfloat16->bfloat16)" in message
    assert "ignored_params" not in message
    assert prim.calls == []


def test_by_dtype_with_real_fully_shard_makes_each_unit_an_fsdp_module() -> None:
    block = master_weights(Block(), "gate.proj.weight")
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.fully_shard_by_dtype(block, mesh, BF16_POLICY, None, ("sinks",))
        sharded = {f for f, m in block.named_modules() if isinstance(m, FSDPModule)}
    assert sharded == {"attn.q", "attn.o", "attn.sinks", "mlp", "gate"}
    assert all(isinstance(p, DTensor) for p in block.parameters())


# --------------------------------------------------------------------------- fully_shard_across_blocks


def test_across_blocks_makes_one_call_with_every_blocks_holder() -> None:
    blocks = [Block() for _ in range(3)]
    prim = RecordingPrimitive()
    fsdptx.fully_shard_across_blocks(blocks, ["attn.sinks"], MESH, BF16_POLICY, None, shard_module=prim)  # type: ignore[arg-type]
    assert prim.targets() == [[b.attn.sinks for b in blocks]]


def test_across_blocks_unit_is_fp32_internal_and_not_resharded() -> None:
    prim = RecordingPrimitive()
    fsdptx.fully_shard_across_blocks([Block(), Block()], ["attn.sinks"], MESH, BF16_POLICY, None, shard_module=prim)  # type: ignore[arg-type]
    kwargs = prim.calls[0][1]
    assert kwargs["reshard_after_forward"] is False
    assert kwargs["mp_policy"] == MixedPrecisionPolicy(
        param_dtype=FP32, reduce_dtype=FP32, output_dtype=None, cast_forward_inputs=False
    )


def test_across_blocks_makes_one_call_per_name() -> None:
    blocks = [Block(), Block()]
    prim = RecordingPrimitive()
    fsdptx.fully_shard_across_blocks(blocks, ["attn.sinks", "gate"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert prim.targets() == [[b.attn.sinks for b in blocks], [b.gate for b in blocks]]


def test_across_blocks_looks_through_checkpoint_wrappers() -> None:
    blocks = [Block(), Block()]
    wrapped = [checkpoint_wrapper(b) for b in blocks]
    prim = RecordingPrimitive()
    fsdptx.fully_shard_across_blocks(wrapped, ["attn.sinks"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert prim.targets() == [[b.attn.sinks for b in blocks]]


@pytest.mark.parametrize(
    "hold",
    [
        lambda layers: layers,
        lambda layers: nn.ModuleDict({str(i): b for i, b in enumerate(layers)}),
        lambda layers: tuple(layers),
        lambda layers: (b for b in layers),
    ],
    ids=["ModuleList", "ModuleDict", "tuple", "generator"],
)
def test_across_blocks_takes_the_blocks_as_the_model_holds_them(hold: Callable[[nn.ModuleList], object]) -> None:
    model = make_decoder(3)
    prim = RecordingPrimitive()
    owned = fsdptx.fully_shard_across_blocks(hold(model.layers), ["attn.sinks"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert prim.targets() == [[b.attn.sinks for b in model.layers]]
    assert {id(p) for p in owned} == {id(b.attn.sinks.weight) for b in model.layers}


@pytest.mark.parametrize("blocks", [Block(), "layers"], ids=["one-block", "str"])
def test_across_blocks_refuses_what_is_not_an_iterable_of_blocks(blocks: object) -> None:
    prim = RecordingPrimitive()
    with pytest.raises(TypeError, match=r"fully_shard_across_blocks: blocks must be an iterable of the blocks.*got"):
        fsdptx.fully_shard_across_blocks(blocks, ["attn.sinks"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert prim.calls == []


def test_across_blocks_does_not_reparent_the_blocks() -> None:
    model = make_decoder()
    prim = RecordingPrimitive()
    fsdptx.fully_shard_across_blocks(list(model.layers), ["attn.sinks"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert [f for f, _ in model.named_modules()] == [f for f, _ in make_decoder().named_modules()]


def test_across_blocks_returns_the_dtensor_params_now_owned() -> None:
    blocks = [Block(), Block()]
    with fake_mesh((2,), ("dp",)) as mesh:
        owned = fsdptx.fully_shard_across_blocks(blocks, ["attn.sinks"], mesh, None, None)
    current = [b.attn.sinks.weight for b in blocks]
    assert len(owned) == 2 and all(any(o is c for c in current) for o in owned)
    assert all(isinstance(p, DTensor) and isinstance(p, nn.Parameter) for p in owned)


def test_across_blocks_params_serve_as_ignored_params_of_enclosing_units() -> None:
    blocks = [Block(), Block()]
    with fake_mesh((2,), ("dp",)) as mesh:
        owned = fsdptx.fully_shard_across_blocks(blocks, ["attn.sinks"], mesh, None, None)
        for b in blocks:
            fsdptx.fully_shard_by_dtype(b, mesh, None, None, ignored_params=owned)
        groups = {id(fully_shard.state(b.attn.sinks)._fsdp_param_group) for b in blocks}
    assert len(groups) == 1 and all(isinstance(b, FSDPModule) for b in blocks)


def test_across_blocks_non_fp32_holder_raises_naming_the_params_before_any_call() -> None:
    prim = RecordingPrimitive()
    with pytest.raises(ValueError, match=r"'mlp'.*0\.mlp\.up\.weight is bfloat16") as info:
        fsdptx.fully_shard_across_blocks([Block(), Block()], ["mlp"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert "1.mlp.down.weight is bfloat16" in str(info.value)
    assert prim.calls == []


def test_across_blocks_unknown_name_raises_naming_it_before_any_call() -> None:
    prim = RecordingPrimitive()
    with pytest.raises(ValueError, match=r"'attn\.sink'"):
        fsdptx.fully_shard_across_blocks(
            [Block(), Block()], ["attn.sinks", "attn.sink"], MESH, None, None, shard_module=prim  # type: ignore[arg-type]
        )
    assert prim.calls == []


# --------------------------------------------------------------------------- configure_fsdp_unused_param_reduction


def test_unused_param_reduction_counts_a_multi_module_unit_once() -> None:
    model = make_decoder(3)
    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks)
    with fake_mesh((2,), ("dp",)) as mesh:
        p = fsdptx.plan(model, pipeline)
        fsdptx.apply_plan(p, model, mesh)
        count = fsdptx.configure_fsdp_unused_param_reduction(model)
    assert count == len(p.units) == 8  # cross-block, 3 x (gate, block), root


def test_unused_param_reduction_sets_the_fsdp_flag_on_every_unit() -> None:
    model = make_decoder()
    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks)
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.apply_plan(fsdptx.plan(model, pipeline), model, mesh)
        groups = {
            id(g): g
            for m in model.modules()
            if isinstance(m, FSDPModule)
            for g in [fully_shard.state(m)._fsdp_param_group]
        }
        before = {g.reduce_scatter_unused_params for g in groups.values()}
        fsdptx.configure_fsdp_unused_param_reduction(model)
        after = {g.reduce_scatter_unused_params for g in groups.values()}
    assert (before, after) == ({False}, {True})


def test_unused_param_reduction_on_unsharded_model_returns_zero() -> None:
    assert fsdptx.configure_fsdp_unused_param_reduction(make_decoder()) == 0


def test_unused_param_reduction_covers_only_the_given_subtree() -> None:
    model = make_decoder()
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.apply_plan(fsdptx.plan(model, fsdptx.shard_by_dtype), model, mesh)
        count = fsdptx.configure_fsdp_unused_param_reduction(model.layers[0])
        root_flag = fully_shard.state(model)._fsdp_param_group.reduce_scatter_unused_params
    assert (count, root_flag) == (3, False)  # sinks, gate, block


# --------------------------------------------------------------------------- MTP / CP guards


class WithSupports(nn.Module):
    def __init__(self, **flags: bool) -> None:
        super().__init__()
        self.supports = SimpleNamespace(**flags)


def test_mtp_cp_rejects_enabled_mtp_without_cp_support() -> None:
    with pytest.raises(ValueError, match="WithSupports.*supports_mtp_cp"):
        fsdptx.reject_unsupported_mtp_cp(WithSupports(mtp_enabled=True, supports_mtp_cp=False))


def test_mtp_cp_accepts_enabled_mtp_with_cp_support() -> None:
    fsdptx.reject_unsupported_mtp_cp(WithSupports(mtp_enabled=True, supports_mtp_cp=True))


def test_mtp_cp_accepts_disabled_mtp() -> None:
    fsdptx.reject_unsupported_mtp_cp(WithSupports(mtp_enabled=False))


def test_mtp_cp_accepts_model_without_supports() -> None:
    fsdptx.reject_unsupported_mtp_cp(make_decoder())


def test_mtp_cp_pp_rejects_pipeline_without_cp_pp_support() -> None:
    model = WithSupports(mtp_enabled=True, supports_mtp_cp=True, supports_mtp_cp_pp=False)
    with pytest.raises(ValueError, match=r"pp_size=2.*supports_mtp_cp_pp"):
        fsdptx.reject_unsupported_mtp_cp_pp(model, pp_size=2)


def test_mtp_cp_pp_accepts_pipeline_with_cp_pp_support() -> None:
    model = WithSupports(mtp_enabled=True, supports_mtp_cp=True, supports_mtp_cp_pp=True)
    fsdptx.reject_unsupported_mtp_cp_pp(model, pp_size=4)


@pytest.mark.parametrize("pp_size", [None, 1])
def test_mtp_cp_pp_without_pipeline_needs_only_cp_support(pp_size: int | None) -> None:
    model = WithSupports(mtp_enabled=True, supports_mtp_cp=True, supports_mtp_cp_pp=False)
    fsdptx.reject_unsupported_mtp_cp_pp(model, pp_size=pp_size)


def test_mtp_cp_pp_still_rejects_missing_cp_support() -> None:
    model = WithSupports(mtp_enabled=True, supports_mtp_cp=False, supports_mtp_cp_pp=True)
    with pytest.raises(ValueError, match="supports_mtp_cp;"):
        fsdptx.reject_unsupported_mtp_cp_pp(model, pp_size=2)


def test_mtp_cp_pp_accepts_model_without_supports() -> None:
    fsdptx.reject_unsupported_mtp_cp_pp(make_decoder(), pp_size=8)


def test_by_dtype_on_a_module_already_sharded_is_refused_naming_it() -> None:
    block = Block()
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.fully_shard_by_dtype(block, mesh, None, None)
        with pytest.raises(ValueError, match="target '<root>' is already an FSDP module"):
            fsdptx.fully_shard_by_dtype(block, mesh, None, None)


# --------------------------------------------------------------------------- ParameterSet


class _NoScan(fsdptx.ParameterSet):
    """A ParameterSet that fails if anything iterates over it."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("the ParameterSet was scanned")


def test_a_parameter_set_is_looked_up_not_scanned() -> None:
    model = make_decoder()
    sinks = _NoScan([model.layers[0].attn.sinks.weight])
    prim = RecordingPrimitive()
    fsdptx.fully_shard_by_dtype(model.layers[0], MESH, BF16_POLICY, None, ignored_params=sinks, shard_module=prim)  # type: ignore[arg-type]
    assert any(kw.get("ignored_params") == {model.layers[0].attn.sinks.weight} for _m, kw in prim.calls)


def test_a_parameter_set_refuses_a_name_when_built() -> None:
    with pytest.raises(TypeError, match="'attn.sinks.weight'"):
        fsdptx.ParameterSet(["attn.sinks.weight"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "add",
    [
        lambda s: s.add("w"),
        lambda s: s.update(["w"]),
        lambda s: s.__ior__({"w"}),
        lambda s: s.symmetric_difference_update({"w"}),
        lambda s: s.__ixor__({"w"}),
    ],
    ids=["add", "update", "ior", "symmetric_difference_update", "ixor"],
)
def test_a_parameter_set_refuses_a_name_added_later(add: Any) -> None:
    s = fsdptx.ParameterSet()
    with pytest.raises(TypeError, match="'w'"):
        add(s)
    assert len(s) == 0


def test_a_plain_set_holding_a_name_is_still_refused() -> None:
    model = make_decoder()
    with pytest.raises(TypeError, match="'attn.sinks.weight'"):
        fsdptx.fully_shard_by_dtype(
            model.layers[0], MESH, BF16_POLICY, None, ignored_params={"attn.sinks.weight"}, shard_module=RecordingPrimitive()  # type: ignore[arg-type]
        )


def test_across_blocks_returns_a_parameter_set() -> None:
    model = make_decoder()
    prim = RecordingPrimitive()
    owned = fsdptx.fully_shard_across_blocks(list(model.layers), ["attn.sinks"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert isinstance(owned, fsdptx.ParameterSet) and isinstance(owned, set)
    assert owned == {b.attn.sinks.weight for b in model.layers}


# --------------------------------------------------------------------------- units remembered across calls
#
# A call on a block shaped like one an earlier call planned takes that call's
# units from a process-wide memo. These tests observe it through the public
# calls only: what the primitive is handed, with the memo on (the default) or
# off (``fsdptx.caches(enabled=False)``), and, where the point is whether a call
# was planned again, a spy on full planning.


@pytest.fixture
def no_earlier_calls() -> Iterator[None]:
    """The memo starts empty, so earlier tests' calls do not count."""
    fsdptx.clear_caches()
    yield
    fsdptx.clear_caches()


def _planned_in_full(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    """The modules whose calls are planned (not taken from the memo) from here on."""
    planned: list[nn.Module] = []
    original = imperative.resolve_units

    def counting(model: nn.Module, **kwargs: Any) -> Any:
        planned.append(model)
        return original(model, **kwargs)

    monkeypatch.setattr(imperative, "resolve_units", counting)
    return planned


def _shard(
    block: nn.Module,
    *,
    mp_policy: MixedPrecisionPolicy | None = BF16_POLICY,
    offload_policy: OffloadPolicy | None = None,
    reshard: bool | int | float | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> RecordingPrimitive:
    """One public ``fully_shard_by_dtype`` call on ``block``; what it handed the primitive."""
    prim = RecordingPrimitive()
    fsdptx.fully_shard_by_dtype(
        block, MESH, mp_policy, offload_policy,  # type: ignore[arg-type]
        reshard_after_forward=reshard, ignored_params=ignored, shard_module=prim,  # type: ignore[arg-type]
    )
    return prim


Recorded = list[tuple[str | list[str], dict[str, Any]]]


def _relative(block: nn.Module, prim: RecordingPrimitive) -> Recorded:
    """What ``prim`` was handed, by names inside ``block``: each unit's
    module name (a list for a unit of several modules) and its keyword
    arguments, ignored parameters by name. A module or parameter from
    outside ``block`` fails the lookup."""
    modules = {id(m): f for f, m in block.named_modules()}
    params = {id(p): f for f, p in block.named_parameters()}
    recorded: Recorded = []
    for target, kwargs in prim.calls:
        named = [modules[id(m)] for m in target] if isinstance(target, list) else modules[id(target)]
        kw = dict(kwargs)
        if "ignored_params" in kw:
            kw["ignored_params"] = sorted(params[id(p)] for p in kw["ignored_params"])
        recorded.append((named, kw))
    return recorded


def _without_memo(block: nn.Module, **settings: Any) -> Recorded:
    """What planning ``block``'s call in full hands the primitive (caches off)."""
    with fsdptx.caches(enabled=False):
        return _relative(block, _shard(block, **settings))


def test_only_the_first_of_blocks_built_alike_is_planned(
    no_earlier_calls: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_decoder(3)
    planned = _planned_in_full(monkeypatch)
    for block in model.layers:
        fsdptx.fully_shard_by_dtype(block, MESH, BF16_POLICY, None, shard_module=mark_sharded)  # type: ignore[arg-type]
    assert planned == [model.layers[0]]


def test_a_remembered_call_hands_the_primitive_what_planning_hands_it(
    no_earlier_calls: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_decoder(2)
    planned = _planned_in_full(monkeypatch)
    _shard(model.layers[0])
    remembered = _relative(model.layers[1], _shard(model.layers[1]))
    assert planned == [model.layers[0]]  # the second call came from the memo
    assert remembered and remembered == _without_memo(make_decoder(2).layers[1])


def test_sharding_a_block_the_memo_knows_calls_the_primitive_on_that_blocks_modules(
    no_earlier_calls: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_decoder(2)
    planned = _planned_in_full(monkeypatch)
    by_dtype(model.layers[0], BF16_POLICY)
    second = by_dtype(model.layers[1], BF16_POLICY)
    inside = {id(m) for m in model.layers[1].modules()}
    assert planned == [model.layers[0]]
    assert second.calls and all(
        id(m) in inside for target in second.targets() for m in (target if isinstance(target, list) else [target])
    )


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda b: b.attn.q.weight.requires_grad_(False), id="a frozen parameter"),
        pytest.param(lambda b: b.mlp.to(torch.float32), id="a cast"),
        pytest.param(lambda b: setattr(b.attn.q.weight, "_hf_compute_dtype", FP32), id="a compute-dtype hint"),
        pytest.param(lambda b: b.mlp.add_module("extra", CastLinear(DIM, DIM, BF16)), id="an added module"),
    ],
)
def test_a_block_that_differs_from_the_remembered_one_is_planned(
    no_earlier_calls: None, monkeypatch: pytest.MonkeyPatch, change: Any
) -> None:
    model, fresh = make_decoder(2), make_decoder(2)
    _shard(model.layers[0])
    change(model.layers[1])
    change(fresh.layers[1])
    planned = _planned_in_full(monkeypatch)
    assert _relative(model.layers[1], _shard(model.layers[1])) == _without_memo(fresh.layers[1])
    assert planned[0] is model.layers[1]


def test_a_call_ignoring_other_parameters_is_planned(no_earlier_calls: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model, fresh = make_decoder(2), make_decoder(2)
    _shard(model.layers[0])
    planned = _planned_in_full(monkeypatch)
    got = _relative(model.layers[1], _shard(model.layers[1], ignored={model.layers[1].attn.sinks.weight}))
    assert got == _without_memo(fresh.layers[1], ignored={fresh.layers[1].attn.sinks.weight})
    assert any(kw.get("ignored_params") == ["attn.sinks.weight"] for _m, kw in got)
    assert planned[0] is model.layers[1]


def test_a_call_with_another_mixed_precision_policy_is_planned(
    no_earlier_calls: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, fresh = make_decoder(2), make_decoder(2)
    other = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    _shard(model.layers[0])
    planned = _planned_in_full(monkeypatch)
    got = _relative(model.layers[1], _shard(model.layers[1], mp_policy=other))
    assert got == _without_memo(fresh.layers[1], mp_policy=other)
    assert planned[0] is model.layers[1]


def test_an_offload_policy_that_is_no_policy_is_refused_as_without_the_memo(no_earlier_calls: None) -> None:
    model = make_decoder(2)
    by_dtype(model.layers[0], BF16_POLICY)
    with pytest.raises(TypeError, match="fully_shard_by_dtype: offload_policy must be an OffloadPolicy or None, got <class .*CPUOffloadPolicy"):
        fsdptx.fully_shard_by_dtype(
            model.layers[1], MESH, BF16_POLICY, CPUOffloadPolicy, shard_module=RecordingPrimitive()  # type: ignore[arg-type]
        )


def test_remembered_units_carry_this_calls_offload_policy_object(
    no_earlier_calls: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An offload policy is a mutable dataclass: the one a call was given is
    the one its units hand the primitive, even when an equal one was
    remembered."""
    model = make_decoder(2)
    first, second = CPUOffloadPolicy(pin_memory=False), CPUOffloadPolicy(pin_memory=False)
    planned = _planned_in_full(monkeypatch)
    _shard(model.layers[0], offload_policy=first)
    prim = _shard(model.layers[1], offload_policy=second)
    assert planned == [model.layers[0]]  # the second call came from the memo
    assert prim.calls and all(kw["offload_policy"] is second for _m, kw in prim.calls)


def test_an_invalid_reshard_value_is_refused_as_given_before_planning(
    no_earlier_calls: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``0.0 == -0.0``: each call is refused naming its own value, at the
    call, so no memo of an earlier call can stand in for it."""
    model = make_decoder(2)
    planned = _planned_in_full(monkeypatch)
    with pytest.raises(ValueError, match=r"fully_shard_by_dtype: reshard_after_forward must be .*got 0\.0"):
        _shard(model.layers[0], reshard=0.0)
    with pytest.raises(ValueError, match=r"fully_shard_by_dtype: reshard_after_forward must be .*got -0\.0"):
        _shard(model.layers[1], reshard=-0.0)
    assert planned == []


class _Stack(nn.ModuleList):
    """A ModuleList subclass: a bare container until something gives it a forward."""


def _stacked_block() -> nn.Module:
    block = nn.Module()
    block.norm = CastLinear(DIM, DIM, BF16)
    block.stack = _Stack([CastLinear(DIM, DIM, FP32) for _ in range(2)])
    block.out = CastLinear(DIM, 4 * DIM, BF16)
    block.extra = CastLinear(DIM, DIM, BF16)  # bf16 the majority: the fp32 stack is isolated
    return block


def test_a_container_class_given_a_forward_after_a_call_is_planned_anew(
    no_earlier_calls: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a ModuleList class is a bare container depends on its
    ``forward``, which a patch may add between two calls."""
    before = _relative(first := _stacked_block(), _shard(first))
    monkeypatch.setattr(_Stack, "forward", lambda self, x: x, raising=False)
    block = _stacked_block()
    planned = _planned_in_full(monkeypatch)
    after = _relative(block, _shard(block))
    assert after == _without_memo(_stacked_block()) and after != before
    assert planned[0] is block


def test_a_block_holding_a_tied_parameter_is_always_planned(
    no_earlier_calls: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its names are not positional, so it is neither remembered nor
    answered from the memo: every block built alike is planned in full."""
    model = make_decoder(3)
    for block in model.layers:
        block.mlp.up.weight = block.mlp.down.weight
    planned = _planned_in_full(monkeypatch)
    for block in model.layers:
        _shard(block)
    assert planned == list(model.layers)


def test_the_memo_keeps_no_model_alive(no_earlier_calls: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_decoder(2)
    planned = _planned_in_full(monkeypatch)
    for block in model.layers:
        fsdptx.fully_shard_by_dtype(block, MESH, BF16_POLICY, None, shard_module=mark_sharded)  # type: ignore[arg-type]
    assert planned == [model.layers[0]]  # the memo remembered the first call and answered the second
    planned.clear()
    gone = weakref.ref(model)
    del model, block
    gc.collect()
    assert gone() is None


def test_reshard_after_forward_one_is_not_taken_for_true(no_earlier_calls: None) -> None:
    """``True == 1`` in Python, but an int asks FSDP to reshard to that many
    ranks: a call with one must not get units recorded for the other."""
    model = make_decoder(2)
    recorded = _shard(model.layers[0], reshard=True)
    units = _shard(model.layers[1], reshard=1)
    assert [type(kw["reshard_after_forward"]) for _m, kw in recorded.calls] == [bool] * len(recorded.calls)
    assert units.calls and {type(kw["reshard_after_forward"]) for _m, kw in units.calls} == {int}
    assert {kw["reshard_after_forward"] for _m, kw in units.calls} == {1}
