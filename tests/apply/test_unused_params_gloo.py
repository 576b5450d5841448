"""Unused-parameter reduction under mixed precision and gradient accumulation
on 2 gloo ranks.

The default training setup: bf16 compute, fp32 reduce, one micro-batch
without gradient sync (``set_requires_gradient_sync(False)``) then one with.
FSDP2 keeps the first micro-batch's gradients as fp32 "accumulated" grads;
a parameter no micro-batch used on one rank gets a zero in the *compute*
dtype (bf16) from torch's unused-parameter path, and the reduce-scatter
refuses the mix ({bfloat16, float32}). fsdptx's
``configure_fsdp_unused_param_reduction`` aligns the dtypes first. Each test
spawns once; the gloo timeout is seconds, not minutes, so a rank left waiting
by a failing peer turns into an error, not a hang.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.testing import fake_mesh, run_distributed

WORLD = 2
COLLECTIVE_TIMEOUT_S = 30.0
SPAWN_TIMEOUT_S = 300.0  # start-up included: minutes on a loaded CI machine
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class _Branchy(nn.Module):
    """``always`` runs on every rank; ``rank0_only`` only where ``use_branch``."""

    def __init__(self) -> None:
        super().__init__()
        self.always = nn.Linear(4, 4)
        self.rank0_only = nn.Linear(4, 4)
        self.late = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_branch: bool, use_late: bool) -> torch.Tensor:
        y = self.always(x)
        if use_branch:
            y = y + self.rank0_only(x)
        if use_late:
            y = y + self.late(x)
        return y


def _inputs(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * rank + step))


def _reference_grads(initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What FSDP2 must produce, computed locally without it: per rank and
    micro-batch, bf16 forward/backward; the first micro-batch's grads are
    kept in fp32 and the second's added to them; the ranks' sums are then
    averaged (FSDP's default divide by the world size), an unused parameter
    contributing zero."""
    total: dict[str, torch.Tensor] = {n: torch.zeros_like(t) for n, t in initial.items()}
    for rank in range(WORLD):
        model = _Branchy().to(torch.bfloat16)
        model.load_state_dict({n: t.to(torch.bfloat16) for n, t in initial.items()})
        acc: dict[str, torch.Tensor] = {}
        for step, late in ((0, False), (1, True)):
            model.zero_grad(set_to_none=True)
            model(_inputs(rank, step).to(torch.bfloat16), rank == 0, late).float().sum().backward()
            for n, p in model.named_parameters():
                if p.grad is not None:
                    acc[n] = acc[n] + p.grad.float() if n in acc else p.grad.float()
        for n, g in acc.items():
            total[n] += g
    return {n: t / WORLD for n, t in total.items()}


def _accumulate_worker(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = _Branchy()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model, mesh=mesh, mp_policy=POLICY)
    assert isinstance(model, FSDPModule)
    configured = fsdptx.configure_fsdp_unused_param_reduction(model)
    # ``late`` is used only in the synced micro-batch: its bf16 grad meets
    # the others' fp32 accumulated grads too.
    for step, (sync, late) in enumerate(((False, False), (True, True))):
        model.set_requires_gradient_sync(sync)
        model(_inputs(rank, step), rank == 0, late).float().sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), n
        grads[n] = p.grad.full_tensor()
    dist.barrier()
    return {"configured": configured, "grads": grads, "expected": _reference_grads(initial)}


def test_accumulated_mixed_precision_grads_with_unused_param_reduce_on_every_rank() -> None:
    results = run_distributed(
        _accumulate_worker, WORLD, timeout_s=SPAWN_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )
    for rank, out in enumerate(results):
        assert out["configured"] == 1
        for name, expected in out["expected"].items():
            got = out["grads"][name]
            assert got.dtype == torch.float32, (rank, name, got.dtype)
            assert torch.allclose(got, expected, rtol=1e-2, atol=1e-2), (rank, name, got, expected)
    # every rank holds the same reduced gradient
    for name in results[0]["grads"]:
        assert torch.equal(results[0]["grads"][name], results[1]["grads"][name]), name
    # the unused-on-rank-1 parameter got rank 0's contribution halved, not zero
    assert results[0]["grads"]["rank0_only.weight"].abs().sum() > 0


def test_configuring_twice_wraps_each_param_group_once() -> None:
    """The dtype alignment is installed once per group, however often the
    manager calls the configuration (a double wrap would be harmless but
    would grow with every call)."""
    with fake_mesh((2,), ("dp",)) as mesh:
        model = _Branchy()
        fully_shard(model, mesh=mesh, mp_policy=POLICY)
        fsdptx.configure_fsdp_unused_param_reduction(model)
        (group,) = fully_shard.state(model)._fsdp_param_groups  # type: ignore[attr-defined]
        first = group.post_backward
        assert fsdptx.configure_fsdp_unused_param_reduction(model) == 1
        assert group.post_backward is first
        assert group.reduce_scatter_unused_params
