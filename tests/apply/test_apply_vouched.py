"""apply_plan trusts what planning derived only while the model is unchanged.

A Plan carries the walk signature of the model its units were resolved against; applying it to that model, unchanged, skips re-deriving each unit's
claims. Anything that could make those claims wrong sends the check down the
full path, which names the problem as before.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import pickle
import types
import weakref

import pytest
import torch
from models import BF16, DIM, CastLinear, make_decoder
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdptx
from fsdptx import Plan, PlanMismatchError
from fsdptx.apply import _check
from fsdptx.model._index import ModelIndex
from fsdptx.plan._vouch import vouch
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import mark_sharded

PIPELINE = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
MESH = object()


def _record(target: nn.Module | list[nn.Module], **kwargs: object) -> None:
    """A primitive that shards nothing."""


class FullChecks:
    """Counts the full (claim-re-deriving) checks apply_plan runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = _check._check_in_full

        def counting(plan: Plan, model: nn.Module, index: ModelIndex) -> list[list[nn.Module]]:
            self.count += 1
            return original(plan, model, index)

        monkeypatch.setattr(_check, "_check_in_full", counting)


def apply(p: Plan, model: nn.Module) -> None:
    fsdptx.apply_plan(p, model, MESH, shard_module=_record)  # type: ignore[arg-type]


def test_a_fresh_plan_on_its_unchanged_model_is_not_checked_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    full = FullChecks(monkeypatch)
    apply(p, model)
    assert full.count == 0


def test_the_vouched_path_resolves_the_same_modules_as_the_full_check() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    vouched = fsdptx.check_plan(p, model)
    with fsdptx.caches(enabled=False):
        full = fsdptx.check_plan(p, model)  # nothing is vouched for with caches off: the full check
    assert [[id(m) for m in ms] for ms in vouched] == [[id(m) for m in ms] for ms in full]


def _hooked(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if m._forward_pre_hooks]


def test_a_vouched_plan_casts_the_inputs_of_the_modules_the_full_path_finds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp32 holders (one cross-block fp32 unit inside a bf16 model) get
    their inputs cast, whether planning recorded them or applying finds
    them from the model."""
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    config = DecoderConfig(vocab=16, dim=8, hidden=16, layers=3, fp32_holders=True, sibling_dtype=BF16)
    vouched, full = Decoder(config), Decoder(config)
    p = fsdptx.plan(vouched, PIPELINE, mp_policy=policy)
    checks = FullChecks(monkeypatch)
    apply(p, vouched)
    assert checks.count == 0
    with fsdptx.caches(enabled=False):
        apply(fsdptx.plan(full, PIPELINE, mp_policy=policy), full)
    assert checks.count == 1
    assert _hooked(vouched) == _hooked(full) == [f"layers.{i}.sinks" for i in range(3)]


def test_casting_after_planning_is_checked_in_full_and_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    model.to(BF16)
    full = FullChecks(monkeypatch)
    with pytest.raises(PlanMismatchError, match="the model was cast after planning"):
        apply(p, model)
    assert full.count == 1


def test_adding_a_parameter_after_planning_is_checked_in_full_and_refused() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    model.layers[0].mlp.extra = CastLinear(DIM, DIM, BF16)
    with pytest.raises(PlanMismatchError, match=r"would also claim \['layers.0.mlp.extra.weight'\]"):
        apply(p, model)


def test_freezing_a_parameter_after_planning_is_checked_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    model.layers[0].attn.q.weight.requires_grad_(False)
    full = FullChecks(monkeypatch)
    apply(p, model)
    assert full.count == 1


def test_replacing_a_parameter_object_after_planning_is_checked_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    old = model.layers[0].attn.q.weight
    model.layers[0].attn.q.weight = nn.Parameter(old.detach().clone())
    full = FullChecks(monkeypatch)
    apply(p, model)
    assert full.count == 1


def test_tying_two_parameters_after_planning_is_checked_in_full_and_refused() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    model.layers[1].attn.q.weight = model.layers[0].attn.q.weight
    with pytest.raises(PlanMismatchError, match="layers.1.attn.q.weight"):
        apply(p, model)


def test_moving_a_parameter_to_another_slot_of_its_module_is_checked_in_full_and_refused() -> None:
    """A bias-free linear keeps a ``None`` bias slot: the weight moved there
    is the same object in the same module, under another name."""
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    q = model.layers[0].attn.q
    q._parameters["bias"], q._parameters["weight"] = q._parameters["weight"], None
    with pytest.raises(PlanMismatchError, match="layers.0.attn.q.bias"):
        apply(p, model)


def test_renaming_a_child_after_planning_is_checked_in_full_and_refused() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    attn = model.layers[0]._modules.pop("attn")
    model.layers[0].add_module("attention", attn)
    with pytest.raises(PlanMismatchError, match="'layers.0.attn.sinks' does not exist"):
        apply(p, model)


def test_swapping_two_children_of_one_class_is_checked_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same names, same classes, same objects: only which module sits under
    which name changed, and with it every FQN below them."""
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    layers = model.layers._modules
    layers["0"], layers["1"] = layers["1"], layers["0"]
    full = FullChecks(monkeypatch)
    apply(p, model)
    assert full.count == 1


def test_a_plan_keeps_no_model_alive() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    assert p.verified is not None
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_sharding_a_module_after_planning_is_refused_without_a_call() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    calls: list[object] = []
    fsdptx.fully_shard_by_dtype(model.layers[0], None, None, None, shard_module=mark_sharded)  # type: ignore[arg-type]
    with pytest.raises(PlanMismatchError, match="already sharded"):
        fsdptx.apply_plan(p, model, MESH, shard_module=lambda t, **kw: calls.append(t))  # type: ignore[arg-type]
    assert calls == []


def test_edited_units_are_checked_in_full_even_when_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    edited = p.replace(units=tuple(list(p.units)))
    full = FullChecks(monkeypatch)
    apply(edited, model)
    assert full.count == 1


def test_edited_reduction_marks_are_checked_in_full_and_refused() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    edited = p.replace(reductions={**p.reductions, "layers.0.nope.weight": "sum"})
    with pytest.raises(PlanMismatchError, match="'layers.0.nope.weight', which the model lacks"):
        apply(edited, model)


def test_a_transform_keeping_the_units_keeps_the_vouching(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_decoder()
    p = fsdptx.plan(model, fsdptx.compose(PIPELINE, fsdptx.checkpoint_activations))
    full = FullChecks(monkeypatch)
    apply(p, model)
    assert full.count == 0


@pytest.mark.parametrize("copy_plan", [copy.deepcopy, lambda p: pickle.loads(pickle.dumps(p))], ids=["deepcopy", "pickle"])
def test_a_copied_plan_is_checked_in_full_and_still_applies(
    monkeypatch: pytest.MonkeyPatch, copy_plan: object
) -> None:
    model = make_decoder()
    p = copy_plan(fsdptx.plan(model, PIPELINE))  # type: ignore[operator]
    full = FullChecks(monkeypatch)
    apply(p, model)
    assert full.count == 1


def test_a_plan_is_not_vouched_for_another_model_of_the_same_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    source, target = make_decoder(), make_decoder(seed=1)
    p = fsdptx.plan(source, PIPELINE)
    full = FullChecks(monkeypatch)
    apply(p, target)
    assert full.count == 1


def test_a_model_with_a_scalar_parameter_is_refused_through_the_full_check() -> None:
    model = make_decoder()
    model.layers[0].attn.register_parameter("scale", nn.Parameter(torch.tensor(1.0, dtype=BF16)))
    p = fsdptx.plan(model, PIPELINE)
    with pytest.raises(PlanMismatchError, match=r"scalar parameters \['layers.0.attn.scale'\]"):
        apply(p, model)


def test_vouching_is_not_part_of_the_plans_value() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    assert p == p.replace(verified=None) and "verified" not in repr(p)


class DeclaredTie(nn.Module):
    """A head tied to the embedding; the head's name sorts first, but the
    declared source is the embedding, so the declaration names the tie."""

    def __init__(self) -> None:
        super().__init__()
        self._tied_weights_keys = {"a_head.weight": "embed.weight"}
        self.embed = nn.Embedding(4, 2, dtype=BF16)
        self.a_head = nn.Linear(2, 4, bias=False, dtype=BF16)
        self.a_head.weight = self.embed.weight


def test_dropping_a_tie_declaration_after_planning_is_checked_in_full_and_refused() -> None:
    model = DeclaredTie()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    assert p.units[-1].params == ("embed.weight",)
    model._tied_weights_keys = None  # type: ignore[assignment]
    with pytest.raises(PlanMismatchError, match=r"would also claim \['a_head.weight'\]"):
        apply(p, model)


def test_reversing_a_tie_declaration_after_marking_is_checked_in_full_and_refused() -> None:
    model = DeclaredTie()
    mark = functools.partial(fsdptx.mark_reduction, reductions={"embed": "sum"})
    p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, mark))
    assert dict(p.reductions) == {"embed.weight": "sum"}
    model._tied_weights_keys = {"embed.weight": "a_head.weight"}  # type: ignore[assignment]
    with pytest.raises(PlanMismatchError, match="'embed.weight', which the model lacks"):
        apply(p, model)


def test_an_unchanged_tie_declaration_keeps_the_vouching(monkeypatch: pytest.MonkeyPatch) -> None:
    model = DeclaredTie()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    full = FullChecks(monkeypatch)
    apply(p, model)
    assert full.count == 0


class ComplexBeside(nn.Module):
    """A complex parameter beside bf16 ones: the planner groups only
    floating parameters by dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=BF16)
        self.rot = nn.Module()
        self.rot.freqs = nn.Parameter(torch.randn(4, dtype=torch.complex64))


def test_a_trainable_complex_parameter_beside_bf16_ones_gets_a_unit_of_its_own() -> None:
    model = ComplexBeside()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    calls: list[object] = []
    fsdptx.apply_plan(p, model, MESH, shard_module=lambda t, **kw: calls.append(t))  # type: ignore[arg-type]
    assert calls == [model.rot, model]
    assert [(u.modules, u.storage_dtype) for u in p.units] == [(("rot",), torch.complex64), (("",), BF16)]


def test_a_frozen_complex_parameter_keeps_the_vouching(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ComplexBeside()
    model.rot.freqs.requires_grad_(False)
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    full = FullChecks(monkeypatch)
    apply(p, model)
    assert full.count == 0


def test_units_the_primitive_would_refuse_are_not_vouched_for() -> None:
    """Settings and module checks run once, when vouching: a unit that
    fails them leaves the plan to the full check, which names the problem."""
    model = make_decoder()
    index = ModelIndex.build(model)
    p = fsdptx.plan(model, PIPELINE)
    assert vouch(index, p.units) is not None
    bad = (dataclasses.replace(p.units[0], reshard_after_forward=-1), *p.units[1:])
    assert vouch(index, bad) is None
    with pytest.raises(PlanMismatchError, match="reshard_after_forward=-1"):
        apply(p.replace(units=bad), model)


def test_a_tie_declaration_changing_type_only_is_checked_in_full_and_refused() -> None:
    """The planner reads a ``dict`` declaration and ignores any other
    mapping, so the same items in a read-only mapping name other sources."""
    model = DeclaredTie()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    model._tied_weights_keys = types.MappingProxyType({"a_head.weight": "embed.weight"})  # type: ignore[assignment]
    with pytest.raises(PlanMismatchError, match="would not reach"):
        apply(p, model)


class _Stack(nn.ModuleList):
    """Given a forward, so a unit of its own; a bare container without."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_a_container_class_losing_its_forward_after_planning_is_checked_in_full_and_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Module()
    model.norm = CastLinear(DIM, DIM, BF16)
    model.stack = _Stack([CastLinear(DIM, DIM, torch.float32) for _ in range(2)])
    model.out = CastLinear(DIM, 4 * DIM, BF16)
    model.extra = CastLinear(DIM, DIM, BF16)  # bf16 the majority: the fp32 stack is isolated
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    assert ("stack",) in [u.modules for u in p.units]
    monkeypatch.delattr(_Stack, "forward")
    with pytest.raises(PlanMismatchError, match="'stack' is a _Stack without forward"):
        apply(p, model)
