"""Properties of planning and applying plans on random module trees.

Trees come from :mod:`fsdptx.testing.strategies`. Two families are used:

* arbitrary trees (parameters on any module, mixed dtypes anywhere), for
  properties that must hold whether or not planning succeeds;
* "leafy" trees, whose parameters sit only on leaf modules and each leaf is
  dtype-uniform: every parameter there can be given a dtype-uniform unit, so
  planning must succeed and the plan can be applied with real ``fully_shard``;
* "direct-uniform" trees, whose modules may hold parameters directly beside
  children of other dtypes but never mix dtypes directly on one module: a
  module's direct parameters get a unit of their own, so these too must plan
  and apply.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import fsdptx
from fsdptx import Plan, PlanningError, Unit
from fsdptx.plan._types import DtypeRequest
from fsdptx.plan.resolve import resolve_units
from fsdptx.plan._fp32_inputs import wholly_fp32_modules
from fsdptx.plan._vouch import vouched_modules
from fsdptx.plan._vouch import reductions_by_module
from fsdptx.testing import fake_mesh
from fsdptx.testing.strategies import ModuleSpec, TreeSpec, build_module, tree_specs

BF16, FP32 = torch.bfloat16, torch.float32
POLICIES: tuple[MixedPrecisionPolicy | None, ...] = (
    None,
    MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32),
    MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16, output_dtype=FP32),
)
policies = st.sampled_from(POLICIES)
# Tokens match module names, so a leaf's parameters are pinned all or none.
fp32_tokens = st.lists(st.sampled_from(["m0.", "m1.", "m2."]), max_size=2, unique=True).map(tuple)

APPLY_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PLAN_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers


def leafy(spec: ModuleSpec) -> ModuleSpec:
    """The same tree with parameters only on leaves, each leaf keeping only the
    parameters of its first parameter's dtype."""
    if spec.children:
        return dataclasses.replace(
            spec, params=(), children=tuple((n, leafy(c)) for n, c in spec.children)
        )
    kept = tuple(p for p in spec.params if p.dtype == spec.params[0].dtype) if spec.params else ()
    return dataclasses.replace(spec, params=kept)


leafy_trees = tree_specs(max_ties=0).map(lambda t: TreeSpec(leafy(t.root)))


def direct_uniform(spec: ModuleSpec) -> ModuleSpec:
    """The same tree with each module keeping only the parameters of its first
    parameter's dtype (parameters stay on inner modules)."""
    kept = tuple(p for p in spec.params if p.dtype == spec.params[0].dtype) if spec.params else ()
    return dataclasses.replace(
        spec, params=kept, children=tuple((n, direct_uniform(c)) for n, c in spec.children)
    )


direct_uniform_trees = tree_specs(max_ties=0).map(lambda t: TreeSpec(direct_uniform(t.root)))


def child_names(model: nn.Module) -> list[str]:
    return [n for n, c in model.named_children()]


@st.composite
def block_choices(draw: st.DrawFn, model: nn.Module) -> list[str]:
    """A random subset of the root's children, in registration order, as blocks."""
    names = child_names(model)
    chosen = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    return [n for n in names if n in chosen]


def snapshot(model: nn.Module) -> list[tuple[str, nn.Parameter, torch.dtype, torch.Size, torch.device]]:
    return [(f, p, p.dtype, p.shape, p.device) for f, p in model.named_parameters(remove_duplicate=False)]


def dtype_key(p: torch.Tensor, mp_policy: MixedPrecisionPolicy | None) -> tuple[torch.dtype, torch.dtype]:
    """(storage, compute) with no pinned names: fp32 master weights compute in
    a lower-precision policy's param dtype."""
    if p.dtype == FP32 and mp_policy is not None and mp_policy.param_dtype == BF16:
        return (FP32, BF16)
    return (p.dtype, p.dtype)


def mixes_groups_directly(model: nn.Module, mp_policy: MixedPrecisionPolicy | None) -> bool:
    """Whether some module holds parameters of two (storage, compute) groups
    directly: the only shape of tree (without ties) that can leave a
    parameter without a dtype-uniform unit."""
    return any(len({dtype_key(p, mp_policy) for p in m.parameters(recurse=False)}) > 1 for m in model.modules())


def fsdp_groups(model: nn.Module) -> list[object]:
    """The distinct FSDP parameter groups under ``model`` (one per unit that owns parameters)."""
    seen: dict[int, object] = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = fully_shard.state(m)._fsdp_param_group
            if group is not None:
                seen.setdefault(id(group), group)
    return list(seen.values())


def apply_on_fake_mesh(model: nn.Module, p: Plan, world: int) -> list[list[nn.Parameter]]:
    """Apply ``p`` with real ``fully_shard``; return each FSDP group's parameters."""
    with fake_mesh((world,), ("dp",)) as mesh:
        fsdptx.apply_plan(p, model, mesh)
        return [[fp.sharded_param for fp in g.fsdp_params] for g in fsdp_groups(model)]  # type: ignore[attr-defined]


def by_dtype(blocks: Sequence[str], tokens: tuple[str, ...]) -> Callable[..., Plan]:
    return functools.partial(fsdptx.shard_by_dtype, blocks=list(blocks), fp32_compute_module_names=tokens)


# --------------------------------------------------------------------------- planning


@PLAN_SETTINGS
@given(spec=tree_specs(), mp_policy=policies, tokens=fp32_tokens, data=st.data())
def test_planning_never_changes_the_model(
    spec: TreeSpec, mp_policy: MixedPrecisionPolicy | None, tokens: tuple[str, ...], data: st.DataObject
) -> None:
    """Invariant: after ``plan`` (successful or not) every parameter FQN names
    the same object with the same dtype, shape and device."""
    model = build_module(spec)
    before = snapshot(model)
    blocks = data.draw(block_choices(model))
    try:
        fsdptx.plan(model, by_dtype(blocks, tokens), mp_policy=mp_policy)
    except PlanningError:
        pass
    after = snapshot(model)
    assert len(after) == len(before)
    for (f0, p0, *meta0), (f1, p1, *meta1) in zip(before, after):
        assert f0 == f1 and p0 is p1 and meta0 == meta1


@PLAN_SETTINGS
@given(spec=tree_specs(max_ties=0), mp_policy=policies, data=st.data())
def test_planning_error_needs_a_module_mixing_groups_directly(
    spec: TreeSpec, mp_policy: MixedPrecisionPolicy | None, data: st.DataObject
) -> None:
    """Invariant: on a tree without tied parameters, ``shard_by_dtype`` only
    fails when some module holds parameters of two (storage, compute) groups
    directly: fully_shard claims a module's direct parameters together. The
    error names the parameters."""
    model = build_module(spec)
    blocks = data.draw(block_choices(model))
    try:
        fsdptx.plan(model, by_dtype(blocks, ()), mp_policy=mp_policy)
    except PlanningError as e:
        assert mixes_groups_directly(model, mp_policy), str(e)
        assert any(f in str(e) for f, _ in model.named_parameters())


@PLAN_SETTINGS
@given(spec=leafy_trees, mp_policy=policies, tokens=fp32_tokens, data=st.data())
def test_planned_units_own_every_parameter_exactly_once(
    spec: TreeSpec, mp_policy: MixedPrecisionPolicy | None, tokens: tuple[str, ...], data: st.DataObject
) -> None:
    """Invariant: on a leafy tree ``shard_by_dtype`` succeeds, and the units'
    ``params`` partition the model's parameters (the root owns the rest)."""
    model = build_module(spec)
    blocks = data.draw(block_choices(model))
    p = fsdptx.plan(model, by_dtype(blocks, tokens), mp_policy=mp_policy)
    owned = [f for u in p.units for f in u.params]
    assert sorted(owned) == sorted(f for f, _ in model.named_parameters())


@PLAN_SETTINGS
@given(spec=leafy_trees, mp_policy=policies, tokens=fp32_tokens, data=st.data())
def test_planned_units_are_storage_and_compute_uniform(
    spec: TreeSpec, mp_policy: MixedPrecisionPolicy | None, tokens: tuple[str, ...], data: st.DataObject
) -> None:
    """Invariant: every unit that owns parameters records one storage and one
    compute dtype, and its policy (when mixed precision is on) computes in it."""
    model = build_module(spec)
    blocks = data.draw(block_choices(model))
    p = fsdptx.plan(model, by_dtype(blocks, tokens), mp_policy=mp_policy)
    params = dict(model.named_parameters())
    for u in p.units:
        if not u.params:
            continue
        assert {params[f].dtype for f in u.params} == {u.storage_dtype}
        assert u.compute_dtype is not None
        if u.mp_policy is not None:
            assert u.mp_policy.param_dtype == u.compute_dtype


# --------------------------------------------------------------------------- applying


@APPLY_SETTINGS
@given(spec=leafy_trees, mp_policy=policies, tokens=fp32_tokens, world=st.sampled_from([2, 4]), data=st.data())
def test_applied_plan_puts_every_parameter_in_exactly_one_fsdp_group(
    spec: TreeSpec,
    mp_policy: MixedPrecisionPolicy | None,
    tokens: tuple[str, ...],
    world: int,
    data: st.DataObject,
) -> None:
    """Invariant: after ``apply_plan`` with real ``fully_shard`` each parameter
    of the model is managed by exactly one FSDP parameter group."""
    model = build_module(spec)
    blocks = data.draw(block_choices(model))
    p = fsdptx.plan(model, by_dtype(blocks, tokens), mp_policy=mp_policy)
    groups = apply_on_fake_mesh(model, p, world)
    for f, param in model.named_parameters():
        holders = [g for g in groups if any(q is param for q in g)]
        assert len(holders) == 1, f"{f} is in {len(holders)} FSDP groups"


@APPLY_SETTINGS
@given(spec=leafy_trees, mp_policy=policies, tokens=fp32_tokens, world=st.sampled_from([2, 4]), data=st.data())
def test_applied_fsdp_groups_are_storage_dtype_uniform(
    spec: TreeSpec,
    mp_policy: MixedPrecisionPolicy | None,
    tokens: tuple[str, ...],
    world: int,
    data: st.DataObject,
) -> None:
    """Invariant: after ``apply_plan`` with real ``fully_shard`` the trainable
    parameters of every FSDP group share one storage dtype (what FSDP2's
    "uniform original parameter dtype" assertion demands)."""
    model = build_module(spec)
    blocks = data.draw(block_choices(model))
    p = fsdptx.plan(model, by_dtype(blocks, tokens), mp_policy=mp_policy)
    groups = apply_on_fake_mesh(model, p, world)
    for g in groups:
        assert len({q.dtype for q in g if q.requires_grad}) <= 1


@APPLY_SETTINGS
@given(spec=direct_uniform_trees, mp_policy=policies, tokens=fp32_tokens, world=st.sampled_from([2, 4]), data=st.data())
def test_direct_uniform_trees_plan_and_apply_with_every_parameter_in_one_uniform_group(
    spec: TreeSpec,
    mp_policy: MixedPrecisionPolicy | None,
    tokens: tuple[str, ...],
    world: int,
    data: st.DataObject,
) -> None:
    """Invariant: when no module mixes dtypes directly, ``shard_by_dtype``
    succeeds even with parameters on inner modules, ``apply_plan`` with real
    ``fully_shard`` accepts the plan (every unit claims what the plan says),
    each parameter lands in exactly one FSDP group, and each group is
    storage-dtype uniform; each unit's policy computes in its compute dtype."""
    model = build_module(spec)
    blocks = data.draw(block_choices(model))
    p = fsdptx.plan(model, by_dtype(blocks, tokens), mp_policy=mp_policy)
    params = dict(model.named_parameters())
    for u in p.units:
        if u.params:
            assert {params[f].dtype for f in u.params} == {u.storage_dtype}
            if u.mp_policy is not None:
                assert u.mp_policy.param_dtype == u.compute_dtype
    groups = apply_on_fake_mesh(model, p, world)
    for f, param in model.named_parameters():
        assert sum(any(q is param for q in g) for g in groups) == 1, f
    for g in groups:
        assert len({q.dtype for q in g}) <= 1


# --------------------------------------------------------------------------- compose


def fp32_holders(block: nn.Module) -> list[str]:
    """Block-relative FQNs of submodules holding only fp32 parameters (at
    least one), in their subtree or directly (beside children of any dtype)."""
    return [
        f
        for f, m in block.named_modules()
        if f
        and any(
            (ps := list(m.parameters(recurse=recurse))) and all(q.dtype == FP32 for q in ps)
            for recurse in (True, False)
        )
    ]


@st.composite
def block_models(draw: st.DrawFn) -> nn.Module:
    """A root with ``layers`` (1-3 copies of one random block template, no
    ties; leafy half of the time so that most examples plan) and an ``extra``
    subtree the root unit must own."""
    general = tree_specs(max_ties=0, max_depth=2)
    template = draw(st.one_of(general.map(lambda t: TreeSpec(leafy(t.root))), general))
    extra = draw(tree_specs(max_ties=0, max_depth=1))
    root = nn.Module()
    root.layers = nn.ModuleList(build_module(template) for _ in range(draw(st.integers(1, 3))))
    root.extra = build_module(extra)
    return root


def plan_or_error(model: nn.Module, transform: Callable[..., Plan], mp_policy: MixedPrecisionPolicy | None) -> Plan | str:
    try:
        return fsdptx.plan(model, transform, mp_policy=mp_policy)
    except PlanningError:
        return "PlanningError"


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=block_models(), mp_policy=policies, data=st.data())
def test_compose_plan_does_not_depend_on_transform_order(
    model: nn.Module, mp_policy: MixedPrecisionPolicy | None, data: st.DataObject
) -> None:
    """Invariant: for any block choice, fp32 cross-block holder and reduction
    mark, all six orders of ``shard_by_dtype``, ``shard_across_blocks`` and
    ``mark_reduction`` give equal Plans, or all fail to plan."""
    n = len(model.layers)
    layer_names = [f"layers.{i}" for i in range(n)]
    dtype_blocks = data.draw(st.lists(st.sampled_from(layer_names), unique=True))
    cross_blocks = data.draw(st.lists(st.sampled_from(layer_names), min_size=1, unique=True))
    holders = fp32_holders(model.layers[0])
    names = [data.draw(st.sampled_from(holders))] if holders else []
    marked = data.draw(st.sampled_from([f for f, _ in model.named_modules()]))
    transforms = (
        functools.partial(fsdptx.shard_by_dtype, blocks=sorted(dtype_blocks)),
        functools.partial(fsdptx.shard_across_blocks, blocks=sorted(cross_blocks), module_names=names),
        functools.partial(fsdptx.mark_reduction, reductions={marked or "*": "sum"}),
    )
    outcomes = [plan_or_error(model, fsdptx.compose(*order), mp_policy) for order in itertools.permutations(transforms)]
    assert all(o == outcomes[0] for o in outcomes[1:]), [str(o) for o in outcomes]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=block_models(), mp_policy=policies, data=st.data())
def test_compose_equals_cross_blocks_then_dtype_step_by_step(
    model: nn.Module, mp_policy: MixedPrecisionPolicy | None, data: st.DataObject
) -> None:
    """Invariant: a composed pipeline gives the Plan (or the failure) of
    applying ``shard_across_blocks`` and then ``shard_by_dtype`` one at a time:
    cross-block units are resolved first whatever the order, and dtype units
    exclude their holders."""
    holders = fp32_holders(model.layers[0])
    names = [data.draw(st.sampled_from(holders))] if holders else []
    by_dtype_t = functools.partial(fsdptx.shard_by_dtype)
    across_t = functools.partial(fsdptx.shard_across_blocks, module_names=names)

    def step_by_step(m: nn.Module, p: Plan) -> Plan:
        return by_dtype_t(m, across_t(m, p))

    composed = plan_or_error(model, fsdptx.compose(by_dtype_t, across_t), mp_policy)
    assert composed == plan_or_error(model, step_by_step, mp_policy)


@PLAN_SETTINGS
@given(spec=tree_specs(max_ties=2), mp_policy=policies, tokens=fp32_tokens, data=st.data())
def test_planning_vouches_only_for_what_the_full_check_accepts(
    spec: TreeSpec, mp_policy: MixedPrecisionPolicy | None, tokens: tuple[str, ...], data: st.DataObject
) -> None:
    """Invariant: a plan that planning vouches for passes the full check on
    the unchanged model (which re-derives every unit's claims), and both
    resolve the same modules for every unit and find the same modules to
    feed fp32 inputs: skipping the re-derivation never accepts what the
    full check would refuse, nor changes what applying does."""
    model = build_module(spec)
    blocks = data.draw(block_choices(model))
    pipeline = fsdptx.compose(by_dtype(blocks, tokens), fsdptx.mark_reduction)
    try:
        p = fsdptx.plan(model, pipeline, mp_policy=mp_policy)
    except PlanningError:
        return
    vouched = vouched_modules(p, model)
    assert vouched is not None
    units, (reduced, excluded), fp32_inputs = vouched
    with fsdptx.caches(enabled=False):
        full = fsdptx.check_plan(p, model)  # the full check: nothing is vouched for with caches off
    assert [[id(m) for m in ms] for ms in units] == [[id(m) for m in ms] for ms in full]
    by_module = reductions_by_module(p.reductions)
    assert [(id(m), dict(r)) for m, r in reduced] == [(id(model.get_submodule(f)), r) for f, r in by_module.items()]
    assert [id(m) for m in excluded] == [id(model.get_submodule(f)) for f in p.exclusions]
    found = wholly_fp32_modules((u.modules, ms, u.params, u.compute_dtype) for u, ms in zip(p.units, full))
    assert fp32_inputs is not None and [id(m) for m in fp32_inputs] == [id(m) for m in found]


@st.composite
def repeated_blocks(draw: st.DrawFn) -> tuple[nn.Module, list[str]]:
    """A root with 2-5 blocks built from one or two random specs, with some
    parameters frozen at random: blocks alike and blocks that differ."""
    specs = [draw(tree_specs(max_ties=0)).root for _ in range(draw(st.integers(1, 2)))]
    root = nn.Module()
    blocks = nn.ModuleList(build_module(TreeSpec(draw(st.sampled_from(specs)))) for _ in range(draw(st.integers(2, 5))))
    root.add_module("blocks", blocks)
    params = [p for _f, p in root.named_parameters()]
    for p in params:
        if draw(st.integers(0, 11)) == 0:
            p.requires_grad_(False)
    return root, [f"blocks.{i}" for i in range(len(blocks))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_blocks=repeated_blocks(), mp_policy=policies, tokens=fp32_tokens, data=st.data())
def test_replayed_blocks_get_the_units_full_planning_gives(
    model_and_blocks: tuple[nn.Module, list[str]],
    mp_policy: MixedPrecisionPolicy | None,
    tokens: tuple[str, ...],
    data: st.DataObject,
) -> None:
    """Invariant: replaying the units of a block planned before onto a block
    built alike (one at a time, or onto a run of them at once) yields exactly the units (order, names, dtypes, policies,
    sizes, ignored parameters) that planning every block in full yields, or
    the same error."""
    model, blocks = model_and_blocks
    names = [f for f, _ in model.named_parameters()]
    ignored = tuple(data.draw(st.lists(st.sampled_from(names), max_size=2, unique=True))) if names else ()
    # In walk order, blocks built alike replay as one run; in any other
    # order each is compared with the one planned before it.
    targets = data.draw(st.one_of(st.just(blocks), st.permutations(blocks)))
    request = DtypeRequest(
        targets=tuple(targets), fp32_compute_module_names=tokens, ignored_params=ignored, reshard_after_forward=None
    )

    def resolve(replay: bool) -> tuple[Unit, ...] | str:
        try:
            return resolve_units(
                model, mp_policy=mp_policy, offload_policy=None, cross_blocks=(), dtype_request=request,
                replay_blocks=replay,
            )
        except PlanningError as e:
            return str(e)

    assert resolve(True) == resolve(False)


class _Recording:
    """Stands in for ``fully_shard``: records ``(modules, kwargs)`` and does nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module | list[nn.Module], dict[str, object]]] = []

    def __call__(self, modules: nn.Module | list[nn.Module], **kwargs: object) -> None:
        self.calls.append((modules, kwargs))


def _imperative_call(
    block: nn.Module, mp_policy: MixedPrecisionPolicy | None, tokens: tuple[str, ...], ignored: set[nn.Parameter] | None
) -> list[tuple[object, dict[str, object]]] | str:
    """One public ``fully_shard_by_dtype`` call on ``block``: what it handed
    the primitive, by names inside ``block`` (a list for a unit of several
    modules; ignored parameters by name), or the error it raised."""
    prim = _Recording()
    try:
        fsdptx.fully_shard_by_dtype(
            block, _MESH, mp_policy, None, tokens, ignored_params=ignored, shard_module=prim  # type: ignore[arg-type]
        )
    except (PlanningError, fsdptx.PlanMismatchError) as e:
        return str(e)
    modules = {id(m): f for f, m in block.named_modules()}
    params = {id(p): f for f, p in block.named_parameters()}
    recorded: list[tuple[object, dict[str, object]]] = []
    for target, kwargs in prim.calls:
        named = [modules[id(m)] for m in target] if isinstance(target, list) else modules[id(target)]
        kw = dict(kwargs)
        if "ignored_params" in kw:
            kw["ignored_params"] = sorted(params[id(p)] for p in kw["ignored_params"])  # type: ignore[attr-defined]
        recorded.append((named, kw))
    return recorded


_MESH = object()  # the recording primitive never looks at the mesh


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_blocks=repeated_blocks(), mp_policy=policies, tokens=fp32_tokens, data=st.data())
def test_imperative_calls_taken_from_the_memo_get_what_planning_gives(
    model_and_blocks: tuple[nn.Module, list[str]],
    mp_policy: MixedPrecisionPolicy | None,
    tokens: tuple[str, ...],
    data: st.DataObject,
) -> None:
    """Invariant: one public imperative call per block, each answered from
    the process-wide memo of earlier calls (of this example or any before
    it, as calls in one process are) whenever a block of the same shape was
    planned, hands the primitive exactly the modules and settings, or
    raises exactly the error, that the same call with caches off gives."""
    model, blocks = model_and_blocks
    for fqn in blocks:
        block = model.get_submodule(fqn)
        params = [p for _f, p in block.named_parameters()]
        ignored = set(data.draw(st.lists(st.sampled_from(params), max_size=1))) if params else None
        remembered = _imperative_call(block, mp_policy, tokens, ignored)
        with fsdptx.caches(enabled=False):
            planned = _imperative_call(block, mp_policy, tokens, ignored)
        assert remembered == planned


# --------------------------------------------------------------------------- caches on and off
#
# Every cache is a layer over a plain function, switched by fsdptx.caches():
# block replay, vouching, the dtype-key and policy memos of one planning, the
# index's derived tables, the fp32 token searches and the imperative API's
# memo of calls. With caches off each result comes from the plain function;
# these properties hold the two to the same answers, errors included.


class _Recorder:
    """Stands in for ``fully_shard``: records each call's modules (as ids)
    and settings, and changes nothing, so one model can be applied twice."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], dict[str, object]]] = []

    def __call__(self, modules: nn.Module | list[nn.Module], **kwargs: object) -> None:
        listed = modules if isinstance(modules, list) else [modules]
        ignored = kwargs.get("ignored_params")
        if isinstance(ignored, set):
            kwargs["ignored_params"] = sorted(map(id, ignored))
        self.calls.append(([id(m) for m in listed], kwargs))


def _applied(p: Plan, model: nn.Module) -> list[tuple[list[int], dict[str, object]]] | str:
    """What applying ``p`` asks of the primitive, or the refusal."""
    recorder = _Recorder()
    try:
        fsdptx.apply_plan(p, model, "mesh", shard_module=recorder)  # type: ignore[arg-type]
    except fsdptx.PlanMismatchError as e:
        return str(e)
    return recorder.calls


def _planned(model: nn.Module, pipeline: Callable[..., Plan], mp_policy: MixedPrecisionPolicy | None) -> Plan | str:
    try:
        return fsdptx.plan(model, pipeline, mp_policy=mp_policy)
    except (PlanningError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_blocks=repeated_blocks(), mp_policy=policies, tokens=fp32_tokens, data=st.data())
def test_planning_and_applying_give_the_same_with_caches_on_and_off(
    model_and_blocks: tuple[nn.Module, list[str]],
    mp_policy: MixedPrecisionPolicy | None,
    tokens: tuple[str, ...],
    data: st.DataObject,
) -> None:
    """Invariant: with caches off (no block replay, no vouching, no memos)
    planning gives the Plan it gives with them on, or the same error, and
    applying that Plan asks the primitive for the same calls; only a Plan
    made with caches on is vouched for."""
    model, blocks = model_and_blocks
    chosen = data.draw(st.lists(st.sampled_from(blocks), min_size=1, unique=True))
    pipeline = fsdptx.compose(by_dtype([b for b in blocks if b in chosen], tokens), fsdptx.mark_reduction)
    cached = _planned(model, pipeline, mp_policy)
    with fsdptx.caches(enabled=False):
        plain = _planned(model, pipeline, mp_policy)
    assert cached == plain
    if isinstance(cached, str) or isinstance(plain, str):
        return
    assert plain.verified is None
    with fsdptx.caches(enabled=False):
        applied_plain = _applied(cached, model)
    assert _applied(cached, model) == applied_plain == _applied(plain, model)


def _change(model: nn.Module, data: st.DataObject) -> None:
    """One change planning would have seen: a cast, a freeze, a replaced or
    an added parameter, or a module swapped for a copy."""
    params = [(f, p) for f, p in model.named_parameters()]
    kind = data.draw(st.sampled_from(["cast", "freeze", "replace", "add", "swap"]))
    if kind == "add" or not params:
        model.register_parameter("added", nn.Parameter(torch.zeros(2, dtype=BF16)))
        return
    fqn, p = data.draw(st.sampled_from(params))
    owner_fqn, _, name = fqn.rpartition(".")
    owner = model.get_submodule(owner_fqn)
    if kind == "cast":
        p.data = p.data.to(FP32 if p.dtype != FP32 else BF16)
    elif kind == "freeze":
        p.requires_grad_(not p.requires_grad)
    elif kind == "replace":
        owner.register_parameter(name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
    elif owner_fqn:
        up_fqn, _, child = owner_fqn.rpartition(".")
        copy = type(owner).__new__(type(owner))
        # Each dict copied as its own type: torch keeps hooks in OrderedDicts it takes weak references to.
        copy.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in owner.__dict__.items()})
        model.get_submodule(up_fqn).add_module(child, copy)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_blocks=repeated_blocks(), mp_policy=policies, data=st.data())
def test_a_plan_made_stale_is_refused_alike_with_caches_on_and_off(
    model_and_blocks: tuple[nn.Module, list[str]],
    mp_policy: MixedPrecisionPolicy | None,
    data: st.DataObject,
) -> None:
    """Invariant: after the model changes under a vouched Plan, applying
    it refuses (or accepts) exactly what the full check refuses (or
    accepts), with the same message: vouching never lets a stale plan
    through."""
    model, blocks = model_and_blocks
    p = _planned(model, fsdptx.compose(by_dtype(blocks, ()), fsdptx.mark_reduction), mp_policy)
    if isinstance(p, str):
        return
    assert p.verified is not None
    _change(model, data)
    with fsdptx.caches(enabled=False):
        plain = _applied(p, model)
    assert _applied(p, model) == plain


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_blocks=repeated_blocks(), mp_policy=policies, tokens=fp32_tokens, data=st.data())
def test_imperative_calls_shard_alike_with_caches_on_and_off(
    model_and_blocks: tuple[nn.Module, list[str]],
    mp_policy: MixedPrecisionPolicy | None,
    tokens: tuple[str, ...],
    data: st.DataObject,
) -> None:
    """Invariant: ``fully_shard_by_dtype`` on each block, its calls
    answered from the process-wide memo where a block alike was planned
    (in this example or any before it), asks the primitive for the calls
    it asks with caches off, or fails alike."""
    model, blocks = model_and_blocks
    ignored = {p for p in model.parameters() if data.draw(st.integers(0, 7)) == 0}

    def shard_each_block() -> list[tuple[list[int], dict[str, object]]] | str:
        recorder = _Recorder()
        try:
            for fqn in blocks:
                fsdptx.fully_shard_by_dtype(
                    model.get_submodule(fqn), "mesh", mp_policy, None, tokens,  # type: ignore[arg-type]
                    ignored_params=ignored, shard_module=recorder,
                )
        except (PlanningError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return recorder.calls

    cached = shard_each_block()
    with fsdptx.caches(enabled=False):
        plain = shard_each_block()
    assert cached == plain
