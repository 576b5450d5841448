"""``FSDP2Manager.parallelize`` with torch's real ``parallelize_module``,
composable ``checkpoint`` and ``fully_shard`` on fake meshes (one process).

The manager promises that ``parallelize`` applies exactly the Plan that
``manager.plan`` prints. These tests hold it to that: for each mesh layout,
every parameter's DTensor layout, every FSDP prefetch chain and reshard flag,
and every checkpointed block is read back from torch's own state and
compared with what the Plan says. Collectives on a fake process group do not
communicate, so values are meaningless here; shapes, layouts and the FSDP
state are not. Bad input must fail before the model is touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._composable.contract import _get_registry
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

import fsdptx.manager
from fsdptx import FSDP2Config, FSDP2Manager, Plan, gradient_sync_context
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh, record_collectives

VOCAB, DIM, HIDDEN, LAYERS = 64, 32, 64, 3
BATCH, SEQ = 2, 8


def _decoder(**overrides: Any) -> Decoder:
    """The ``llama`` preset's architecture at toy size (it declares ``_tp_plan``)."""
    torch.manual_seed(0)
    cfg = dict(vocab=VOCAB, dim=DIM, hidden=HIDDEN, layers=LAYERS)
    cfg.update(overrides)
    return Decoder(DecoderConfig(**cfg))


# --------------------------------------------------------------- a tiny MoE model


class _Experts(nn.Module):
    """Expert weights stacked on dim 0, as MoE layers keep them."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, dim, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bsd,edf->bsf", x, self.w) / self.w.shape[0]


class _MoEBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.experts = _Experts(4, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(self.proj(x))


class _MoEModel(nn.Module):
    _no_split_modules = ["_MoEBlock"]

    def __init__(self, declare_experts: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(_MoEBlock(DIM) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if declare_experts:
            self._fsdptx_expert_modules = ("layers.*.experts",)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


# ---------------------------------------------------------- the layouts expected


def _norm(p: Placement) -> str:
    """``S0``, ``S1`` or ``R``. FSDP shards a parameter that TP already
    shards on dim 0 with ``_StridedShard(0)`` (so the global layout is TP's
    shard then FSDP's), which is still FSDP's dim-0 shard."""
    if isinstance(p, (Shard, _StridedShard)):
        return f"S{p.dim}"
    if isinstance(p, Replicate):
        return "R"
    return repr(p)


def _tp_placement(style: object, module: nn.Module, name: str) -> str | None:
    """What torch's style puts on the ``tp`` dim of this parameter, or None
    when the style leaves parameters alone (input/output preparation)."""
    if isinstance(style, SequenceParallel):
        return "R"
    if isinstance(style, ColwiseParallel):
        return "S1" if isinstance(module, nn.Embedding) else "S0"
    if isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Embedding):
            return "S0"
        return "S1" if name == "weight" else "R"
    return None


def _expected_layouts(
    plan: Plan, model: nn.Module, dp_dims: tuple[tuple[str, str], ...], moe_dims: tuple[tuple[str, str], ...] = ()
) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """param FQN -> (mesh dim names, placements) that applying ``plan``
    must give: the unit's data-parallel dims (dense or MoE mesh as the unit
    says), then ``tp`` where the Plan assigns the owning module a style that
    shards or replicates its parameters."""
    styles = {a.module: a.parallel_style for a in plan.tensor_parallel.assignments} if plan.tensor_parallel else {}
    owner = plan.owned_params
    out: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for fqn, _p in model.named_parameters():
        module_fqn, _, name = fqn.rpartition(".")
        dims = moe_dims if plan.units[owner[fqn]].mesh == "moe" else dp_dims
        names, places = [d for d, _ in dims], [pl for _, pl in dims]
        tp = _tp_placement(styles.get(module_fqn), model.get_submodule(module_fqn), name)
        if tp is not None:
            names.append("tp")
            places.append(tp)
        out[fqn] = (tuple(names), tuple(places))
    return out


def _actual_layouts(model: nn.Module) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    out = {}
    for fqn, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{fqn} is not a DTensor after parallelize"
        out[fqn] = (tuple(p.device_mesh.mesh_dim_names or ()), tuple(_norm(pl) for pl in p.placements))
    return out


def _unit_modules(model: nn.Module) -> dict[int, str]:
    """FSDP state id -> FQN of the unit's (first) module."""
    out: dict[int, str] = {}
    for fqn, m in model.named_modules():
        if isinstance(m, FSDPModule):
            out.setdefault(id(fully_shard.state(m)), fqn)
    return out


def _prefetch_chains(model: nn.Module) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The explicit chains FSDP2 stores, by unit FQN (units without any omitted)."""
    names = _unit_modules(model)
    out = {}
    for fqn, m in model.named_modules():
        if isinstance(m, FSDPModule):
            state = fully_shard.state(m)
            fwd = tuple(names[id(s)] for s in state._states_to_forward_prefetch)
            bwd = tuple(names[id(s)] for s in state._states_to_backward_prefetch)
            if fwd or bwd:
                out[fqn] = (fwd, bwd)
    return out


def _reshard_flags(model: nn.Module) -> dict[str, bool]:
    """FSDP2 keeps a post-forward mesh exactly when a unit reshards after
    forward (read before the first forward: lazy init clears the root's)."""
    return {
        fqn: fully_shard.state(m)._fsdp_param_group.post_forward_mesh_info is not None
        for fqn, m in model.named_modules()
        if isinstance(m, FSDPModule)
    }


def _checkpointed(model: nn.Module) -> set[str]:
    return {fqn for fqn, m in model.named_modules() if "checkpoint" in (_get_registry(m) or {})}


def _train_step(model: nn.Module) -> torch.Tensor:
    out = model(torch.randint(0, VOCAB, (BATCH, SEQ)))
    local = out.to_local() if isinstance(out, DTensor) else out
    local.float().sum().backward()
    return local


# ------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    """One mesh layout and config; ``dp_dims`` are the data-parallel mesh
    dims FSDP must shard over, each with its placement."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    dp_dims: tuple[tuple[str, str], ...]
    config: dict[str, Any] = field(default_factory=dict)


_NO_MP: dict[str, Any] = {"mp_policy": None}
CASES: dict[str, Case] = {
    "dp8": Case((8,), ("dp",), (("dp", "S0"),), {**_NO_MP, "activation_checkpointing": True}),
    "dp2-tp2": Case((2, 2), ("dp", "tp"), (("dp", "S0"),), {**_NO_MP, "activation_checkpointing": "full"}),
    "dp2-tp2-sp": Case(
        (2, 2), ("dp", "tp"), (("dp", "S0"),), {**_NO_MP, "sequence_parallel": True, "activation_checkpointing": "full"}
    ),
    "hsdp-tp2-sp-bf16": Case(
        (2, 2, 2),
        ("dp_replicate", "dp_shard", "tp"),
        (("dp_replicate", "R"), ("dp_shard", "S0")),
        {"sequence_parallel": True, "activation_checkpointing": "full"},
    ),
    "dp_shard2-cp2": Case((2, 2), ("dp_shard", "cp"), (("dp_shard_cp", "S0"),), dict(_NO_MP)),
}


@dataclass
class Parallelized:
    case: Case
    mesh: DeviceMesh
    manager: FSDP2Manager
    model: nn.Module
    applied: Plan  # what parallelize applied (apply_plan's checks and effects, reading its one index)
    expected: Plan  # manager.plan of a fresh, identical model
    fresh: nn.Module


@pytest.fixture(params=list(CASES), ids=list(CASES))
def parallelized(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Parallelized]:
    case = CASES[request.param]
    applied: list[Plan] = []
    real = fsdptx.manager.apply_indexed

    def recording_apply_plan(plan: Plan, *args: Any, **kwargs: Any) -> nn.Module:
        applied.append(plan)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(fsdptx.manager, "apply_indexed", recording_apply_plan)
    with fake_mesh(case.shape, case.names) as mesh:
        manager = FSDP2Manager(FSDP2Config(**case.config), mesh)
        fresh = _decoder()
        expected = manager.plan(fresh)
        model = manager.parallelize(_decoder())
        assert len(applied) == 1
        yield Parallelized(case, mesh, manager, model, applied[0], expected, fresh)


# ------------------------------------------------------- layouts follow the Plan


def test_parallelize_applies_the_plan_that_manager_plan_shows(parallelized: Parallelized) -> None:
    assert parallelized.applied == parallelized.expected


def test_every_parameter_has_the_mesh_dims_and_placements_the_plan_says(parallelized: Parallelized) -> None:
    want = _expected_layouts(parallelized.expected, parallelized.fresh, parallelized.case.dp_dims)
    assert _actual_layouts(parallelized.model) == want


def test_prefetch_chains_are_the_planned_ones(parallelized: Parallelized) -> None:
    want = {c.unit: (c.forward, c.backward) for c in parallelized.expected.prefetch}
    assert _prefetch_chains(parallelized.model) == want


def test_reshard_after_forward_flags_are_the_planned_ones(parallelized: Parallelized) -> None:
    want = {u.modules[0]: u.reshard_after_forward for u in parallelized.expected.units}
    assert _reshard_flags(parallelized.model) == want


def test_checkpointing_sits_on_the_planned_blocks(parallelized: Parallelized) -> None:
    ac = parallelized.expected.checkpointing
    assert _checkpointed(parallelized.model) == (set(ac.modules) if ac else set())


def test_forward_and_backward_run_and_every_parameter_gets_a_gradient(parallelized: Parallelized) -> None:
    out = _train_step(parallelized.model)
    assert out.shape[:2] == (BATCH, SEQ)
    missing = [f for f, p in parallelized.model.named_parameters() if p.grad is None]
    assert missing == []


# ------------------------------------------------- what each mesh layout implies


def _plan_for(shape: tuple[int, ...], names: tuple[str, ...], **config: Any) -> Plan:
    with fake_mesh(shape, names) as mesh:
        return FSDP2Manager(FSDP2Config(mp_policy=None, **config), mesh).plan(_decoder())


def test_blocks_reshard_except_the_last_and_the_root_never() -> None:
    plan = _plan_for((2, 2), ("dp", "tp"))
    flags = {u.modules[0]: u.reshard_after_forward for u in plan.units}
    assert flags == {"layers.0": True, "layers.1": True, "layers.2": False, "": False}


def test_prefetch_chains_reach_forward_and_backward_depth_blocks() -> None:
    plan = _plan_for((4,), ("dp",), fsdp2_forward_prefetch_depth=1, fsdp2_backward_prefetch_depth=2)
    assert {c.unit: (c.forward, c.backward) for c in plan.prefetch} == {
        "layers.0": (("layers.1",), ()),
        "layers.1": (("layers.2",), ("layers.0",)),
        "layers.2": ((), ("layers.1", "layers.0")),
    }


def test_disabled_prefetch_sets_no_chain_in_fsdp() -> None:
    with fake_mesh((2,), ("dp",)) as mesh:
        model = FSDP2Manager(FSDP2Config(mp_policy=None, enable_fsdp2_prefetch=False), mesh).parallelize(_decoder())
        assert _prefetch_chains(model) == {}


def test_sequence_parallel_norms_are_replicated_on_tp() -> None:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        model = FSDP2Manager(FSDP2Config(mp_policy=None, sequence_parallel=True), mesh).parallelize(_decoder())
        norms = {f: p for f, p in model.named_parameters() if "norm" in f}
        assert len(norms) == 2 * LAYERS + 1
        for fqn, p in norms.items():
            assert p.device_mesh.mesh_dim_names == ("dp", "tp"), fqn
            assert p.placements[1] == Replicate(), fqn


def test_without_sequence_parallel_norms_stay_off_the_tp_dim() -> None:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        model = FSDP2Manager(FSDP2Config(mp_policy=None), mesh).parallelize(_decoder())
        dims = {f: p.device_mesh.mesh_dim_names for f, p in model.named_parameters() if "norm" in f}
        assert set(dims.values()) == {("dp",)}


def test_hsdp_params_replicate_over_dp_replicate_and_shard_over_dp_shard() -> None:
    with fake_mesh((2, 2), ("dp_replicate", "dp_shard")) as mesh:
        model = FSDP2Manager(FSDP2Config(mp_policy=None), mesh).parallelize(_decoder())
        w = model.layers[0].attn.q_proj.weight
        assert w.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert tuple(w.placements) == (Replicate(), Shard(0))
        assert w.to_local().shape == (DIM // 2, DIM)


def test_context_parallel_folds_cp_into_the_shard_dim() -> None:
    with fake_mesh((2, 2), ("dp_shard", "cp")) as mesh:
        model = FSDP2Manager(FSDP2Config(mp_policy=None), mesh).parallelize(_decoder())
        w = model.layers[0].mlp.gate_proj.weight
        assert w.device_mesh.size() == 4
        assert w.to_local().shape == (HIDDEN // 4, DIM)


def test_context_parallel_sets_unused_param_reduction_on_every_unit() -> None:
    with fake_mesh((2, 2), ("dp_shard", "cp")) as mesh:
        manager = FSDP2Manager(FSDP2Config(mp_policy=None), mesh)
        assert manager.plan(_decoder()).reduce_unused_params is True
        model = manager.parallelize(_decoder())
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert len(units) == LAYERS + 1
        assert all(fully_shard.state(m)._fsdp_param_group.reduce_scatter_unused_params for m in units)


def test_without_context_parallel_unused_param_reduction_stays_off() -> None:
    with fake_mesh((4,), ("dp",)) as mesh:
        manager = FSDP2Manager(FSDP2Config(mp_policy=None), mesh)
        assert manager.plan(_decoder()).reduce_unused_params is False
        model = manager.parallelize(_decoder())
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert not any(fully_shard.state(m)._fsdp_param_group.reduce_scatter_unused_params for m in units)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_keeps_parameter_names_and_state_dict_keys(mode: str) -> None:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        plain = FSDP2Manager(FSDP2Config(mp_policy=None), mesh).parallelize(_decoder())
        ac = FSDP2Manager(FSDP2Config(mp_policy=None, activation_checkpointing=mode), mesh).parallelize(_decoder())
        assert [f for f, _ in ac.named_parameters()] == [f for f, _ in plain.named_parameters()]
        assert list(ac.state_dict()) == list(plain.state_dict()) == list(_decoder().state_dict())


@pytest.mark.parametrize("mp", ["disabled", "default-bf16"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_tp_sp_fsdp_model_runs_forward_and_backward(mode: str, mp: str) -> None:
    """Recompute re-enters FSDP's forward hooks (composable checkpoint sits
    on the same module as the FSDP unit); the default policy's input casts
    must not upset selective checkpointing's replay."""
    config = FSDP2Config(
        sequence_parallel=True, activation_checkpointing=mode, **({"mp_policy": None} if mp == "disabled" else {})
    )
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        model = FSDP2Manager(config, mesh).parallelize(_decoder())
        assert _train_step(model).shape == (BATCH, SEQ, VOCAB)


# ---------------------------------------------------------------------- MoE mesh


def _moe_meshes(mesh: DeviceMesh) -> DeviceMesh:
    """A MoE view of the same 4 ranks: ``ep`` (not data parallel) of size 1
    x ``ep_shard``. With ``ep`` > 1 the experts would be split by expert,
    which needs a model that dispatches tokens (tests/test_expert_parallel_*)."""
    return DeviceMesh("cpu", torch.arange(4).reshape(1, 4), mesh_dim_names=("ep", "ep_shard"))


@pytest.mark.parametrize("source", ["config", "model-declaration"])
def test_expert_units_shard_over_the_moe_mesh_data_parallel_dims(source: str) -> None:
    config = FSDP2Config(mp_policy=None, expert_modules=("layers.*.experts",) if source == "config" else None)
    with fake_mesh((4,), ("dp",)) as mesh:
        manager = FSDP2Manager(config, mesh, moe_mesh=_moe_meshes(mesh))
        model = _MoEModel(declare_experts=source == "model-declaration")
        plan = manager.plan(model)
        manager.parallelize(model)
        want = _expected_layouts(plan, _MoEModel(), (("dp", "S0"),), (("ep_shard", "S0"),))
        assert _actual_layouts(model) == want
        assert want["layers.0.experts.w"] == (("ep_shard",), ("S0",))


def test_expert_units_are_on_the_moe_mesh_and_excluded_from_tp_replica_sync() -> None:
    config = FSDP2Config(mp_policy=None, expert_modules=("layers.*.experts",))
    with fake_mesh((4,), ("dp",)) as mesh:
        plan = FSDP2Manager(config, mesh, moe_mesh=_moe_meshes(mesh)).plan(_MoEModel())
    experts = {"layers.0.experts", "layers.1.experts"}
    assert {u.modules[0] for u in plan.units if u.mesh == "moe"} == experts
    assert {u.modules[0] for u in plan.units if u.kind == "expert"} == experts
    assert experts <= set(plan.exclusions)


def test_moe_model_runs_forward_and_backward() -> None:
    config = FSDP2Config(mp_policy=None, expert_modules=("layers.*.experts",))
    with fake_mesh((4,), ("dp",)) as mesh:
        model = FSDP2Manager(config, mesh, moe_mesh=_moe_meshes(mesh)).parallelize(_MoEModel())
        assert _train_step(model).shape == (BATCH, SEQ, VOCAB)


# ------------------------------------------------- bad input fails before mutation


def _snapshot(model: nn.Module) -> list[int]:
    return [id(p) for p in model.parameters()]


def _assert_untouched(model: nn.Module, before: list[int]) -> None:
    assert _snapshot(model) == before
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    assert not _checkpointed(model)


def _parallelize_fails(model: nn.Module, shape: tuple[int, ...], names: tuple[str, ...], match: str, **config: Any) -> None:
    before = _snapshot(model)
    with fake_mesh(shape, names) as mesh:
        manager = FSDP2Manager(FSDP2Config(mp_policy=None, activation_checkpointing=True, **config), mesh)
        with pytest.raises(ValueError, match=match):
            manager.parallelize(model)
    _assert_untouched(model, before)


def test_explicit_tp_pattern_matching_nothing_fails_before_mutation() -> None:
    _parallelize_fails(_decoder(), (2, 2), ("dp", "tp"), "layers.*.attn.qkv", tp_plan={"layers.*.attn.qkv": "colwise"})


def test_sharded_dim_not_divisible_by_tp_fails_before_mutation() -> None:
    _parallelize_fails(_decoder(hidden=6), (2, 4), ("dp", "tp"), r"out_features=6 is not divisible by tp=4")


def test_head_count_not_divisible_by_tp_fails_before_mutation() -> None:
    model = _decoder()
    model.config = SimpleNamespace(num_attention_heads=3)  # type: ignore[assignment]
    _parallelize_fails(model, (2, 2), ("dp", "tp"), r"num_attention_heads=3 is not divisible by tp=2")


def test_head_counts_are_not_checked_when_the_plan_shards_only_the_embedding_and_the_head() -> None:
    """GPT-OSS's declared plan: no attention is split, so no head count
    needs to divide the TP size."""
    model = _decoder()
    model.config = SimpleNamespace(num_attention_heads=3)  # type: ignore[assignment]
    ends = {"embed_tokens": "embedding_rowwise", "lm_head": "colwise_rep"}
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        FSDP2Manager(FSDP2Config(mp_policy=None, tp_plan=ends), mesh).parallelize(model)
    assert isinstance(model.lm_head.weight, DTensor)


def test_unknown_style_name_fails_at_config_construction() -> None:
    with pytest.raises(ValueError, match="unknown style 'diagonal'"):
        FSDP2Config(tp_plan={"lm_head": "diagonal"})


def test_unknown_mesh_dim_name_fails_at_manager_construction() -> None:
    with fake_mesh((2, 2), ("dp", "foo")) as mesh, pytest.raises(ValueError, match="foo"):
        FSDP2Manager(FSDP2Config(), mesh)


def test_moe_mesh_over_another_world_size_fails_before_mutation() -> None:
    model = _MoEModel()
    before = _snapshot(model)
    config = FSDP2Config(mp_policy=None, expert_modules=("layers.*.experts",))
    with fake_mesh((4,), ("dp",)) as mesh:
        too_small = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("ep_shard",))
        with pytest.raises(ValueError, match="moe_mesh spans 2 ranks"):
            FSDP2Manager(config, mesh, moe_mesh=too_small).parallelize(model)
    _assert_untouched(model, before)


def test_parallelizing_a_model_twice_fails_and_leaves_it_as_the_first_call_did() -> None:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        manager = FSDP2Manager(FSDP2Config(mp_policy=None, sequence_parallel=True), mesh)
        model = manager.parallelize(_decoder())
        before = _snapshot(model)
        layouts = _actual_layouts(model)
        with pytest.raises(ValueError, match="already"):
            manager.parallelize(model)
        assert _snapshot(model) == before
        assert _actual_layouts(model) == layouts


# ---------------------------------------------------------- gradient_sync_context


def _reduce_grads(model: nn.Module) -> set[bool]:
    return {fully_shard.state(m)._fsdp_param_group.reduce_grads for m in model.modules() if isinstance(m, FSDPModule)}


@pytest.fixture
def fsdp_model() -> Iterator[nn.Module]:
    with fake_mesh((2,), ("dp",)) as mesh:
        yield FSDP2Manager(FSDP2Config(mp_policy=None), mesh).parallelize(_decoder())


def test_deferred_sync_is_off_inside_for_a_non_final_micro_batch_and_restored_after(fsdp_model: nn.Module) -> None:
    with gradient_sync_context(fsdp_model, is_optimizer_step=False):
        assert _reduce_grads(fsdp_model) == {False}
    assert _reduce_grads(fsdp_model) == {True}


def test_deferred_sync_stays_on_for_the_micro_batch_that_ends_the_step(fsdp_model: nn.Module) -> None:
    with gradient_sync_context(fsdp_model, is_optimizer_step=True):
        assert _reduce_grads(fsdp_model) == {True}


def test_deferred_sync_is_restored_when_the_backward_raises(fsdp_model: nn.Module) -> None:
    with pytest.raises(RuntimeError, match="boom"), gradient_sync_context(fsdp_model, is_optimizer_step=False):
        raise RuntimeError("boom")
    assert _reduce_grads(fsdp_model) == {True}


def test_without_defer_nothing_changes(fsdp_model: nn.Module) -> None:
    with gradient_sync_context(fsdp_model, is_optimizer_step=False, defer=False):
        assert _reduce_grads(fsdp_model) == {True}


def _reduce_scatters_per_micro_batch(model: nn.Module, defer: bool) -> list[int]:
    counts = []
    for i in range(3):
        with gradient_sync_context(model, is_optimizer_step=i == 2, defer=defer), record_collectives() as calls:
            _train_step(model)
        counts.append(sum(1 for c in calls if "reduce_scatter" in c.op))
    return counts


def test_deferred_micro_batches_reduce_scatter_only_on_the_last(fsdp_model: nn.Module) -> None:
    counts = _reduce_scatters_per_micro_batch(fsdp_model, defer=True)
    assert counts[:2] == [0, 0] and counts[2] > 0


def test_undeferred_micro_batches_reduce_scatter_every_time(fsdp_model: nn.Module) -> None:
    counts = _reduce_scatters_per_micro_batch(fsdp_model, defer=False)
    assert len(set(counts)) == 1 and counts[0] > 0


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_matmuls(mode: str) -> int:
    with fake_mesh((2,), ("dp",)) as mesh:
        model = FSDP2Manager(FSDP2Config(activation_checkpointing=mode), mesh).parallelize(_decoder())
        out = model(torch.randint(0, VOCAB, (BATCH, SEQ)))
        with _CountMatmuls() as counter:
            out.float().sum().backward()
    return counter.count


def test_selective_checkpointing_replays_fewer_matmuls_than_full() -> None:
    """Selective keeps matmul outputs, so its backward recomputes fewer of
    them than full checkpointing does (with the default bf16 policy, whose
    FSDP input casts run inside the replay)."""
    assert _backward_matmuls("selective") < _backward_matmuls("full")


def test_settings_that_need_a_tp_dim_say_so_when_the_mesh_has_none(caplog: pytest.LogCaptureFixture) -> None:
    """Sequence and loss parallelism without a tp dim are warnings on the
    Plan's first lines (the manager logs them when it parallelizes); the
    plan is otherwise the one without them."""
    config = FSDP2Config(sequence_parallel=True, loss_parallel=True, tp_plan={"lm_head": "colwise_rep"})
    with caplog.at_level("INFO", logger="fsdptx.manager"), fake_mesh((2,), ("dp",)) as mesh:
        planned = FSDP2Manager(config, mesh).plan(_decoder())
        plain = FSDP2Manager(FSDP2Config(), mesh).plan(_decoder())
    assert "tp_plan is not applied" in caplog.text
    assert [w.partition(" has no effect")[0] for w in planned.warnings] == ["sequence_parallel=True", "loss_parallel=True"]
    assert str(planned).startswith("warning: sequence_parallel=True has no effect: the mesh has no tp dim")
    assert planned.tensor_parallel is None
    assert planned.replace(warnings=()) == plain
