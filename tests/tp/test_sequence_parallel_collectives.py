"""Sequence parallelism costs no more than torchtitan's: TP collectives of one
training step (forward and backward, then the once-per-step TP-replica
sync), recorded on a fake (dp=2, tp=2) mesh, for fsdptx's plans against the
same model parallelized by hand in torchtitan's pattern (``titan_pattern``),
which has no sync to call.

The targets: no more TP all-reduces per step than the hand-parallelized
model, and no TP all-reduce larger than the largest replicated parameter
(the norms' weight gradients): an activation is never all-reduced. A
region's projections share one all-gather in forward and one reduce-scatter
in backward; handing them a plain tensor instead cost one all-reduce of the
activation per projection.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig, Titan, TitanConfig
from fsdptx.testing import Collective, fake_mesh, record_collectives

import hf_zoo
from titan_pattern import explicit_plan, parallelize_by_hand

TP_GROUP = (0, 1)  # rank 0's TP peers on a (dp=2, tp=2) mesh


def _titan() -> nn.Module:
    torch.manual_seed(0)
    return Titan(TitanConfig(vocab=64, dim=32, n_heads=4, n_kv_heads=2, hidden=64, layers=2, max_seq_len=16))


def _decoder() -> nn.Module:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=2))


def _hf_llama() -> nn.Module:
    torch.manual_seed(0)
    return hf_zoo.llama("cpu", torch.float32)


def _hf_sp(model: nn.Module) -> dict[str, Any]:
    norms = {g: "sequence_parallel" for g in ("layers.*.attn_norm", "layers.*.mlp_norm", "norm")}
    return {**model._tp_plan, "embed_tokens": "rowwise_rep", **norms}  # type: ignore[dict-item]


# case -> (model builder, the layout the by-hand pattern uses, the tp_plan fsdptx gets)
CASES: dict[str, tuple[Callable[[], nn.Module], str, Callable[[nn.Module, bool], Any]]] = {
    "torchtitan_way": (_titan, "titan", lambda m, lp: explicit_plan("titan", loss_parallel=lp)),
    "hf_declared_sp": (_decoder, "decoder", lambda m, lp: _hf_sp(m)),
    "derived": (_decoder, "decoder", lambda m, lp: None),
    "hf_llama_derived": (_hf_llama, "hf_llama", lambda m, lp: None),
}


def _step(model: nn.Module, tokens: torch.Tensor, loss_parallel: bool) -> list[Collective]:
    with record_collectives() as calls:
        out = model(tokens)
        logits = out.logits if hasattr(out, "logits") else out
        if loss_parallel:
            with fsdptx.loss_parallel():
                F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        else:
            F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    return calls


def _nbytes(c: Collective) -> int:
    return max(torch.Size(s).numel() * d.itemsize for s, d in zip(c.shapes, c.dtypes))


def _all_reduces(calls: list[Collective]) -> list[Collective]:
    return [c for c in calls if c.group == TP_GROUP and c.op in ("all_reduce", "allreduce_")]


def _largest_replicated_param(model: nn.Module) -> int:
    """Bytes of the largest parameter that is whole on every TP rank."""
    sizes = []
    for p in model.parameters():
        spec = p.placements if isinstance(p, DTensor) else ()
        tp_placement = spec[-1] if spec else None
        if tp_placement is None or tp_placement.is_replicate():
            local = p.to_local() if isinstance(p, DTensor) else p
            sizes.append(local.numel() * local.element_size() * (2 if isinstance(p, DTensor) and len(spec) > 1 else 1))
    return max(sizes)


@functools.cache
def _measure(case: str, loss_parallel: bool) -> dict[str, Any]:
    build, layout, plan_of = CASES[case]
    tokens = torch.arange(16).reshape(2, 8) % 64
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        hand = parallelize_by_hand(build(), layout, mesh, loss_parallel=loss_parallel)
        by_hand = _step(hand, tokens, loss_parallel)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        model = build()
        config = fsdptx.FSDP2Config(
            sequence_parallel=True, mp_policy=None, tp_plan=plan_of(model, loss_parallel), loss_parallel=loss_parallel
        )
        fsdptx.FSDP2Manager(config, mesh).parallelize(model)
        ours = _step(model, tokens, loss_parallel)
        largest = _largest_replicated_param(model)
        grads = {fqn: p.grad for fqn, p in model.named_parameters()}
        with record_collectives() as sync:
            synced = fsdptx.synchronize_tp_replica_gradients([model], mesh)
    return {"hand": by_hand, "ours": ours, "largest": largest, "sync": sync, "synced": synced, "grads": grads}


# Loss parallelism on the models whose loss the test computes from the logits.
RUNS = [(c, False) for c in CASES] + [(c, True) for c in CASES if c != "hf_llama_derived"]


@pytest.mark.parametrize(("case", "loss_parallel"), RUNS)
def test_no_more_tp_all_reduces_per_step_than_torchtitans_pattern(case: str, loss_parallel: bool) -> None:
    found = _measure(case, loss_parallel)
    ours, hand = _all_reduces(found["ours"]), _all_reduces(found["hand"])
    assert len(ours) <= len(hand), (len(ours), len(hand))
    ours_bytes = sum(map(_nbytes, ours))
    assert ours_bytes <= sum(map(_nbytes, hand)), ours_bytes


@pytest.mark.parametrize(("case", "loss_parallel"), RUNS)
def test_no_tp_all_reduce_carries_more_than_the_largest_replicated_parameter(case: str, loss_parallel: bool) -> None:
    found = _measure(case, loss_parallel)
    largest = max(map(_nbytes, _all_reduces(found["ours"])), default=0)
    assert 0 < largest <= found["largest"], (largest, found["largest"])


def test_tp_collectives_per_step_match_torchtitans_pattern_op_for_op() -> None:
    """Beyond the all-reduces: all-gathers and reduce-scatters too, and their
    bytes, for the plan written torchtitan's way and for the derived one."""
    for case in ("torchtitan_way", "derived"):
        found = _measure(case, False)
        tally = lambda calls: sorted((c.op, _nbytes(c)) for c in calls if c.group == TP_GROUP)  # noqa: E731
        assert tally(found["ours"]) == tally(found["hand"]), case


def test_hf_llama_derived_all_reduces_only_norm_gradients() -> None:
    """On Hugging Face Llama the derived plan all-reduces only the
    sequence-parallel norms' weight gradients (hidden 64, fp32: 256 B)."""
    found = _measure("hf_llama_derived", False)
    sizes = {_nbytes(c) for c in _all_reduces(found["ours"])}
    assert sizes == {64 * 4}, sizes


def _tp_tally(calls: list[Collective]) -> tuple[int, int]:
    """(count, bytes) of the TP collectives in ``calls``."""
    tp = [c for c in calls if c.group == TP_GROUP]
    return len(tp), sum(map(_nbytes, tp))


# The cases whose by-hand baseline lays the model out as fsdptx's plan does.
SAME_LAYOUT = [(c, lp) for c, lp in RUNS if CASES[c][1] in ("titan", "decoder")]


@pytest.mark.parametrize(("case", "loss_parallel"), SAME_LAYOUT)
def test_a_step_with_its_tp_replica_sync_costs_no_more_tp_collectives_than_torchtitans_pattern(
    case: str, loss_parallel: bool
) -> None:
    """Forward, backward and ``synchronize_tp_replica_gradients`` together,
    against torchtitan's forward and backward: the sync adds nothing where
    every replicated parameter is one DTensor already keeps alike (the
    sequence-parallel norms), neither the norms' all-reduce nor its agreement."""
    found = _measure(case, loss_parallel)
    ours = _tp_tally(found["ours"] + found["sync"])
    hand = _tp_tally(found["hand"])
    assert ours[0] <= hand[0] and ours[1] <= hand[1], (ours, hand)
    assert _tp_tally(found["sync"]) == (0, 0), found["sync"]


@pytest.mark.parametrize(("case", "loss_parallel"), SAME_LAYOUT)
def test_the_sync_leaves_out_the_norm_gradients_dtensor_already_reduced(case: str, loss_parallel: bool) -> None:
    """The norms' gradients arrive as ``Replicate`` DTensors on the tp dim
    (DTensor's Partial -> Replicate all-reduce in backward, the step's only
    TP all-reduces), so none of them is counted as synchronized: with no
    plain replica in these models, the count is 0 (it was one per norm)."""
    found = _measure(case, loss_parallel)
    norms = {f for f in found["grads"] if "norm" in f}
    assert len(norms) == 2 * 2 + 1  # two per block, and the final norm
    for fqn in norms:
        grad = found["grads"][fqn]
        assert isinstance(grad, DTensor) and grad.placements[-1].is_replicate(), (fqn, grad)
    assert len(_all_reduces(found["ours"])) == len(norms)
    # Every other gradient is TP-sharded: no plain replica is left to reduce.
    others = [f for f, g in found["grads"].items() if f not in norms and g is not None]
    assert all(isinstance(g, DTensor) and g.placements[-1].is_shard() for g in map(found["grads"].get, others))
    assert found["synced"] == 0
