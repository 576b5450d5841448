"""audit_replicas on 4 gloo ranks finds exactly the copies that drifted.

The toy scenario of the TP-replica sync (``Decoder`` preset with one fp32
``sinks`` holder per block, dp=2 x tp=2, sequence parallelism, fp32): under
SP each TP rank's holder sees half the sequence, so without
``synchronize_tp_replica_gradients`` the holders of two TP peers take
different SGD steps, and nothing else does (DTensor reduces the sharded and
SP-norm gradients itself). An HSDP mesh (dp_replicate=2 x dp_shard=2) with
one replica's shard perturbed by hand checks the data-parallel side. All
scenarios run in one spawn of 4 processes; argument checks run on a fake
mesh in this process.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import assert_replicas_in_sync, fake_mesh, record_collectives, run_distributed

WORLD = 4
CFG = DecoderConfig(vocab=64, dim=32, hidden=64, layers=2, fp32_holders=True)
SP_FP32 = fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None)
PERTURBED = "layers.1.attn.q_proj.weight"


def make_model() -> Decoder:
    torch.manual_seed(0)
    model = Decoder(CFG)
    with torch.no_grad():
        for block in model.layers:
            block.sinks.weight.normal_(0, 0.1)
    return model


def train(model: nn.Module, mesh: Any, *, sync: bool, dp_rank: int) -> None:
    """Three SGD steps on this dp rank's share of a fixed batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, CFG.vocab, (4, 9), generator=g)[dp_rank * 2 : dp_rank * 2 + 2]
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, CFG.vocab), tokens[:, 1:].reshape(-1)).backward()
        if sync:
            fsdptx.synchronize_tp_replica_gradients([model], mesh)
        opt.step()


def summary(audit: fsdptx.ReplicaAudit) -> dict[str, Any]:
    return {
        "ok": audit.ok,
        "drifted": [(d.fqn, d.mesh_dim, d.ranks, d.max_abs_diff) for d in audit.drifted],
        "text": str(audit),
    }


def checksum_blind_drifts(model: nn.Module, mesh: Any) -> dict[str, Any]:
    """Drifts a plain sum or norm of the copies cannot see, on TP rank 1 of
    each TP group: two elements swapped, then (with an infinity in the same
    place on every rank, which makes any sum infinite) one other element
    changed."""
    out: dict[str, Any] = {}
    tp_rank = mesh.get_coordinate()[1]
    weight = dict(model.named_parameters())[SINKS[0]]
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    with torch.no_grad():
        local.copy_(torch.arange(local.numel(), dtype=local.dtype).reshape(local.shape) / 8)
        if tp_rank == 1:
            flat = local.view(-1)
            flat[0], flat[1] = flat[1].clone(), flat[0].clone()
        out["swapped"] = summary(fsdptx.audit_replicas([model], mesh))
        local.copy_(torch.arange(local.numel(), dtype=local.dtype).reshape(local.shape) / 8)
        local.view(-1)[0] = math.inf
        out["inf_everywhere"] = summary(fsdptx.audit_replicas([model], mesh))
        if tp_rank == 1:
            local.view(-1)[2] += 0.5
        out["inf_and_a_change"] = summary(fsdptx.audit_replicas([model], mesh))
        if tp_rank == 1:
            local.view(-1)[2] = math.nan
        out["nan_on_one_copy"] = summary(fsdptx.audit_replicas([model], mesh, rtol=0.1))
    return out


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_coordinate()[0]
    for name, sync in (("synced", True), ("unsynced", False)):
        model = make_model()
        fsdptx.FSDP2Manager(SP_FP32, mesh).parallelize(model)
        train(model, mesh, sync=sync, dp_rank=dp_rank)
        out[name] = summary(fsdptx.audit_replicas([model], mesh))
        with fsdptx.caches(enabled=False):
            out[f"{name}_uncached"] = summary(fsdptx.audit_replicas([model], mesh))
        if sync:
            out.update(checksum_blind_drifts(model, mesh))
        if not sync:
            try:
                assert_replicas_in_sync(model, mesh)
            except AssertionError as e:
                out["assertion"] = str(e)
            # a tolerance above the drift accepts it
            biggest = max(d[3] for d in out[name]["drifted"])
            out["tolerated"] = fsdptx.audit_replicas([model], mesh, atol=biggest * 1.01).ok

    # One rank holds an extra parameter: its TP group disagrees on what to
    # compare, and every rank of the mesh raises instead of hanging.
    model = make_model()
    fsdptx.FSDP2Manager(SP_FP32, mesh).parallelize(model)
    if rank == 3:
        model.register_parameter("stray", nn.Parameter(torch.zeros(3)))
    try:
        fsdptx.audit_replicas([model], mesh)
        out["disagreement"] = None
    except RuntimeError as e:
        out["disagreement"] = str(e)

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = make_model()
    fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=None), hsdp).parallelize(model)
    out["hsdp_clean"] = summary(fsdptx.audit_replicas([model], hsdp, buffers=True))
    if rank == 2:  # dp_replicate 1, dp_shard 0: one copy of one shard
        weight = dict(model.named_parameters())[PERTURBED]
        assert isinstance(weight, DTensor)
        with torch.no_grad():
            weight.to_local()[0, 0] += 0.25
    out["hsdp_perturbed"] = summary(fsdptx.audit_replicas([model], hsdp))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, timeout_s=300, collective_timeout_s=60)


SINKS = [f"layers.{i}.sinks.weight" for i in range(CFG.layers)]


def test_with_tp_replica_sync_every_copy_stays_identical(runs: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(runs):
        assert r["synced"]["ok"], f"rank {rank}: {r['synced']['text']}"
        assert r["synced"]["drifted"] == []


def test_without_tp_replica_sync_exactly_the_sinks_drift_in_both_tp_groups(runs: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(runs):
        found = r["unsynced"]["drifted"]
        assert not r["unsynced"]["ok"]
        assert [(f, dim, ranks) for f, dim, ranks, _ in found] == [
            (fqn, "tp", group) for fqn in SINKS for group in ((0, 1), (2, 3))
        ], f"rank {rank}"
        assert all(diff > 1e-4 for *_, diff in found)


def test_the_audit_finds_the_same_drift_with_its_tensor_cache_off(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        for name in ("synced", "unsynced"):
            assert r[f"{name}_uncached"] == r[name], name


def test_two_swapped_elements_are_named_though_their_sum_and_norm_agree(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert [(f, dim, ranks, diff) for f, dim, ranks, diff in r["swapped"]["drifted"]] == [
            (SINKS[0], "tp", group, 0.125) for group in ((0, 1), (2, 3))
        ]


def test_an_infinity_on_every_copy_is_no_drift_and_hides_no_other_change(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert r["inf_everywhere"]["ok"], r["inf_everywhere"]["text"]
        assert [(f, dim, ranks, diff) for f, dim, ranks, diff in r["inf_and_a_change"]["drifted"]] == [
            (SINKS[0], "tp", group, 0.5) for group in ((0, 1), (2, 3))
        ]


def test_a_nan_on_one_copy_is_an_infinite_drift_under_any_tolerance(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert [(f, dim, ranks, diff) for f, dim, ranks, diff in r["nan_on_one_copy"]["drifted"]] == [
            (SINKS[0], "tp", group, math.inf) for group in ((0, 1), (2, 3))
        ]


def test_the_audit_is_identical_on_every_rank(runs: list[dict[str, Any]]) -> None:
    for key in ("synced", "unsynced", "hsdp_clean", "hsdp_perturbed"):
        assert all(r[key]["drifted"] == runs[0][key]["drifted"] for r in runs), key


def test_assert_replicas_in_sync_fails_with_a_table_naming_fqn_dim_ranks_and_difference(
    runs: list[dict[str, Any]],
) -> None:
    message = runs[0]["assertion"]
    lines = message.splitlines()
    assert lines[1].split() == ["fqn", "dim", "ranks", "max", "abs", "diff"]
    assert lines[3].split()[:3] == ["layers.0.sinks.weight", "tp", "0,1"]
    assert all(r["assertion"] == message for r in runs)


def test_a_tolerance_above_the_drift_accepts_it(runs: list[dict[str, Any]]) -> None:
    assert all(r["tolerated"] for r in runs)


def test_peers_that_disagree_on_the_tensors_raise_on_every_rank(runs: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(runs):
        assert r["disagreement"] is not None, f"rank {rank} returned"
        # rank 3's stray plain parameter is a copy along dp and along tp
        assert "disagree on which tensors to compare along ['dp', 'tp']" in r["disagreement"]
    # The ranks of a disagreeing group (tp: 2,3; dp: 1,3) name the stray
    # parameter; rank 0, in neither, points at them.
    assert all("stray" in runs[rank]["disagreement"] for rank in (1, 2, 3))
    assert "See the error on the ranks of those groups" in runs[0]["disagreement"]


def test_hsdp_replicas_are_clean_after_parallelize(runs: list[dict[str, Any]]) -> None:
    assert all(r["hsdp_clean"]["ok"] for r in runs)


def test_a_perturbed_hsdp_replica_is_named_with_the_dp_replicate_dim(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert [(f, dim, ranks) for f, dim, ranks, _ in r["hsdp_perturbed"]["drifted"]] == [
            (PERTURBED, "dp_replicate", (0, 2))
        ]
        assert r["hsdp_perturbed"]["drifted"][0][3] == pytest.approx(0.25)


# ---------------------------------------------------------------- fake mesh


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"atol": -1.0}, ValueError, "atol"),
        ({"rtol": float("nan")}, ValueError, "rtol"),
        ({"atol": "0"}, TypeError, "atol"),
        ({"buffers": 1}, TypeError, "buffers"),
        ({"tp_axis_name": 0}, TypeError, "tp_axis_name"),
    ],
)
def test_invalid_arguments_raise_before_any_collective(kwargs: dict[str, Any], error: type, named: str) -> None:
    model = make_model()
    with fake_mesh((2, 2), ("dp", "tp")) as mesh, record_collectives() as calls:
        with pytest.raises(error, match=named):
            fsdptx.audit_replicas([model], mesh, **kwargs)
    assert calls == []


def test_a_mesh_or_model_of_the_wrong_kind_raises_before_any_collective() -> None:
    model = make_model()
    with fake_mesh((2, 2), ("dp", "tp")) as mesh, record_collectives() as calls:
        with pytest.raises(TypeError, match="model_parts"):
            fsdptx.audit_replicas("model", mesh)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="model_parts is empty"):
            fsdptx.audit_replicas([], mesh)
        with pytest.raises(TypeError, match="device_mesh"):
            fsdptx.audit_replicas([model], None)  # type: ignore[arg-type]
    assert calls == []


def test_on_a_fake_mesh_the_audit_compares_the_tp_replicated_params_and_passes() -> None:
    model = make_model()
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        fsdptx.FSDP2Manager(SP_FP32, mesh).parallelize(model)
        with record_collectives() as calls:
            audit = fsdptx.audit_replicas([model], mesh)
    assert audit.ok and audit.drifted == ()
    # norms (2 per block + final) and the sinks: what the sync keeps in step
    assert dict(audit.checked) == {"dp": 0, "tp": 7}
    assert {c.op for c in calls} == {"allreduce_"}


def test_a_clean_audit_of_a_tp_only_mesh_is_one_collective() -> None:
    """The layout and a digest of every checksum travel together; the
    checksums themselves only when those digests differ."""
    model = make_model()
    with fake_mesh((2,), ("tp",)) as mesh:
        fsdptx.FSDP2Manager(SP_FP32, mesh).parallelize(model)
        with record_collectives() as calls:
            audit = fsdptx.audit_replicas([model], mesh)
    assert audit.ok and dict(audit.checked) == {"tp": 7}
    assert [c.op for c in calls] == ["allreduce_"]


def test_audit_every_n_steps_audits_on_the_nth_step_only() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[int] = []
    step = [0]

    def fake_audit(parts: Any, mesh: Any, **kw: Any) -> fsdptx.ReplicaAudit:
        seen.append(step[0])
        return fsdptx.ReplicaAudit((fsdptx.Drift("weight", "tp", (0, 1), 1.0),), ())

    drifts: list[fsdptx.ReplicaAudit] = []
    handle = fsdptx.audit_replicas_every(opt, [model], None, 3, on_drift=drifts.append, audit=fake_audit)  # type: ignore[arg-type]
    for step[0] in range(1, 8):
        opt.step()
    handle.remove()
    opt.step()
    assert seen == [3, 6] and len(drifts) == 2


def test_audit_every_n_steps_raises_the_table_by_default() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def fake_audit(parts: Any, mesh: Any, **kw: Any) -> fsdptx.ReplicaAudit:
        return fsdptx.ReplicaAudit((fsdptx.Drift("weight", "tp", (0, 1), 0.5),), ())

    fsdptx.audit_replicas_every(opt, [model], None, 1, audit=fake_audit)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match=r"after optimizer step 1:.*\n.*fqn.*dim.*ranks.*max abs diff"):
        opt.step()


def test_audit_every_refuses_a_step_count_below_one() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="every"):
        fsdptx.audit_replicas_every(opt, [], None, 0)  # type: ignore[arg-type]
