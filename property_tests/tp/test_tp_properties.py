"""Properties of TP-replica synchronization over random models on fake meshes.

Each example builds one random logical model (``fsdptx.testing.strategies``:
fp32/bf16 parameters, float and int64 buffers) plus a tied parameter pair, marks
some modules ``"sum"`` and excludes some subtrees, and then plays every rank of
a fake (dp=2, tp=2) world in turn. Each rank builds the model with its own
registration order (a different shuffle seed), which is exactly what must not
change the collectives: a rank that issues a different sequence hangs the job.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdptx import (
    broadcast_tp_replicas,
    exclude_from_tp_replica_sync,
    iter_unique_named_parameters,
    mark_tp_replica_gradient_reduction,
    synchronize_tp_replica_gradients,
)
from fsdptx.testing import Collective, fake_mesh, record_collectives
from fsdptx.testing.strategies import (
    ModuleSpec,
    TensorSpec,
    TreeSpec,
    build_module,
    tree_specs,
)

MESH_SHAPE = (2, 2)
MESH_NAMES = ("dp", "tp")
TP_SIZE = 2
WORLD = 4

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Scenario:
    """One logical model and what is done to it on every rank."""

    spec: TreeSpec
    sum_modules: frozenset[str]  # module FQNs marked "sum"
    excluded_modules: frozenset[str]  # module FQNs excluded from sync
    no_grad: frozenset[str]  # param FQNs whose grad stays None (on every rank)
    shuffle_seeds: tuple[int, ...]  # one registration order per rank
    max_bytes: int


def _module_fqns(m: ModuleSpec, prefix: str = "") -> list[str]:
    out = [prefix]
    for name, child in m.children:
        out += _module_fqns(child, f"{prefix}.{name}" if prefix else name)
    return out


def _with_tie(spec: TreeSpec, shape: tuple[int, ...], dtype: torch.dtype) -> TreeSpec:
    """``spec`` plus two children ``tie_a``/``tie_b`` whose ``w`` is one Parameter."""
    leaf = ModuleSpec(params=(TensorSpec("w", shape, dtype),), buffers=(), children=())
    root = ModuleSpec(spec.root.params, spec.root.buffers, (*spec.root.children, ("tie_a", leaf), ("tie_b", leaf)))
    return TreeSpec(root, (*spec.ties, ("tie_b.w", "tie_a.w")))


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    base = draw(tree_specs(max_depth=2, max_children=3, max_params=2, max_buffers=1, max_ties=1))
    shape = draw(st.sampled_from([(3,), (2, 2)]))
    spec = _with_tie(base, shape, draw(st.sampled_from([torch.float32, torch.bfloat16])))
    modules = _module_fqns(spec.root)
    subset = st.lists(st.sampled_from(modules), unique=True, max_size=3).map(frozenset)
    params = spec.param_fqns()
    # The tie gets its own marks, half the time conflicting: which name's mark
    # wins must not depend on a rank's registration order.
    tie_marks = draw(st.sampled_from([frozenset(), frozenset({"tie_a"}), frozenset({"tie_b"})]))
    return Scenario(
        spec=spec,
        sum_modules=draw(subset) | tie_marks,
        excluded_modules=draw(st.lists(st.sampled_from(modules[1:] or [""]), unique=True, max_size=2).map(frozenset)),
        no_grad=draw(st.lists(st.sampled_from(params), unique=True, max_size=2).map(frozenset)),
        shuffle_seeds=tuple(draw(st.lists(st.integers(0, 2**16), min_size=WORLD, max_size=WORLD))),
        max_bytes=draw(st.sampled_from([16, 40, 100, 1 << 20])),
    )


def _grad_for(fqn: str, p: torch.Tensor) -> torch.Tensor:
    """A value fixed by the FQN alone, so every rank holds the same grad (the
    fake group does not exchange values anyway) and halving it is exact."""
    seed = sum(map(ord, fqn)) % 11
    return (torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape) + seed + 0.5).to(p.dtype)


def _build_rank_model(sc: Scenario, rank: int) -> nn.Module:
    model = build_module(sc.spec, shuffle_seed=sc.shuffle_seeds[rank])
    for fqn in sorted(sc.sum_modules):
        mark_tp_replica_gradient_reduction(model.get_submodule(fqn), "sum")
    for fqn in sorted(sc.excluded_modules):
        exclude_from_tp_replica_sync(model.get_submodule(fqn))
    for fqn, p in iter_unique_named_parameters(model):
        p.grad = None if fqn in sc.no_grad else _grad_for(fqn, p)
    return model


class _PayloadRecorder(TorchDispatchMode):
    """Copies of the tensors each c10d collective is handed, in issue order."""

    def __init__(self, out: list[list[torch.Tensor]]) -> None:
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            flat = [a for a in args if isinstance(a, torch.Tensor)]
            flat += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            self.out.append([t.clone() for t in flat])
        return func(*args, **(kwargs or {}))


@contextmanager
def _record_payloads() -> Iterator[list[list[torch.Tensor]]]:
    out: list[list[torch.Tensor]] = []
    with _PayloadRecorder(out):
        yield out


@dataclass
class RankRun:
    calls: list[Collective]
    payloads: list[list[torch.Tensor]]
    model: nn.Module
    counts: tuple[int, int]  # (broadcast, synchronized)


def _run_rank(sc: Scenario, rank: int) -> RankRun:
    model = _build_rank_model(sc, rank)
    with fake_mesh(MESH_SHAPE, MESH_NAMES, rank=rank) as mesh:
        with record_collectives() as calls, _record_payloads() as payloads:
            n_broadcast = broadcast_tp_replicas([model], mesh, max_bytes=sc.max_bytes)
            n_synced = synchronize_tp_replica_gradients([model], mesh, max_bytes=sc.max_bytes)
    return RankRun(calls, payloads, model, (n_broadcast, n_synced))


def _tp_group(rank: int) -> tuple[int, ...]:
    start = rank - rank % TP_SIZE
    return tuple(range(start, start + TP_SIZE))


def _names_of(model: nn.Module) -> dict[int, list[str]]:
    """Every FQN under which each parameter object is reachable (ties: several)."""
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    return names


def _owner(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _under(module_fqn: str, excluded: frozenset[str]) -> bool:
    return any(e == "" or module_fqn == e or module_fqn.startswith(e + ".") for e in excluded)


@SETTINGS
@given(scenarios())
def test_collective_sequence_is_identical_on_every_rank_whatever_the_registration_order(sc: Scenario) -> None:
    """Invariant: broadcast + synchronize issue the same sequence of (op,
    shapes, dtypes) on all 4 ranks of a (dp=2, tp=2) mesh, each collective on
    that rank's own TP group, even though every rank registered modules,
    parameters and buffers in a different order; and the returned counts agree."""
    runs = [_run_rank(sc, r) for r in range(WORLD)]
    reference = [(c.op, c.shapes, c.dtypes) for c in runs[0].calls]
    assert reference, "the agreement all-to-all is always issued"
    for rank, run in enumerate(runs):
        assert [(c.op, c.shapes, c.dtypes) for c in run.calls] == reference, f"rank {rank}"
        assert {c.group for c in run.calls} == {_tp_group(rank)}, f"rank {rank}"
        assert run.counts == runs[0].counts, f"rank {rank}"


@SETTINGS
@given(scenarios())
def test_collective_payloads_are_aligned_on_every_rank_whatever_the_registration_order(sc: Scenario) -> None:
    """Invariant: every rank puts the same values in the same slot of every
    collective (the int64 agreement vector included). Tensor values here
    depend only on their FQN, so equal payloads mean that each buffer element
    holds the same logical tensor element on every rank, whatever order the
    rank registered things in: equal shapes alone could hide a permutation
    of tensors inside a flat buffer."""
    runs = [_run_rank(sc, r) for r in range(WORLD)]
    for rank, run in enumerate(runs[1:], start=1):
        assert len(run.payloads) == len(runs[0].payloads), f"rank {rank}"
        for i, (mine, ref) in enumerate(zip(run.payloads, runs[0].payloads)):
            assert len(mine) == len(ref) and all(torch.equal(a, b) for a, b in zip(mine, ref)), (
                f"rank {rank}: collective {i} ({run.calls[i].op}) carries different data than on rank 0"
            )


@SETTINGS
@given(scenarios())
def test_fake_group_result_is_grad_over_tp_size_for_mean_and_grad_for_sum(sc: Scenario) -> None:
    """Invariant (fake all-reduce returns the local input): after
    synchronization an unmarked gradient is ``grad / tp_size``, a gradient of
    a "sum"-marked module's direct parameter is ``grad``, a gradient under an
    excluded subtree is untouched, dtypes are kept, and every rank (each with
    its own registration order) ends with the same gradients, including for a
    tied parameter reachable under two names."""
    results: list[dict[str, torch.Tensor | None]] = []
    for rank in range(WORLD):
        model = _run_rank(sc, rank).model
        names = _names_of(model)
        after: dict[str, torch.Tensor | None] = {}
        for fqn, p in iter_unique_named_parameters(model):
            all_names = names[id(p)]
            before = None if fqn in sc.no_grad else _grad_for(fqn, p)
            after[fqn] = p.grad
            if before is None:
                assert p.grad is None, fqn
                continue
            assert p.grad is not None and p.grad.dtype == p.dtype, fqn
            mean = (before.double() / TP_SIZE).to(p.dtype)
            if any(_under(_owner(n), sc.excluded_modules) for n in all_names):
                assert torch.equal(p.grad, before), f"{fqn} is excluded"
            elif len(all_names) == 1:
                expect = before if _owner(fqn) in sc.sum_modules else mean
                assert torch.equal(p.grad, expect), fqn
            else:  # tied: one of the two reductions, the same on every rank (below)
                assert torch.equal(p.grad, before) or torch.equal(p.grad, mean), fqn
        results.append(after)
    for rank, after in enumerate(results[1:], start=1):
        assert after.keys() == results[0].keys()
        for fqn, g in after.items():
            ref = results[0][fqn]
            assert (g is None and ref is None) or (g is not None and ref is not None and torch.equal(g, ref)), (
                f"rank {rank}: {fqn}"
            )
