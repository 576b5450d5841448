"""Pieces the dry run's modules share: the usage error, rows of repeated
units, rank 0's parameter shards and the CLI's bounds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from ..core._meshes import KNOWN_DIMS, ParallelDims
from ..core._names import collapse_keyed, join_names
from ..core._torch_internals import StridedShard, local_tensor
from ..plan._plan import Plan
from ._report import ParamShard, local_shape


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


_DP_DIMS = tuple(n for n in KNOWN_DIMS if n not in ("tp", "pp"))


MAX_WORLD = 65536
"""Largest fake world the dry run builds (``--mesh``, ``--fit``). Beyond it
the mesh alone takes gigabytes and minutes; no real job is that large either."""


MAX_LAYERS = 4096
"""The largest ``--layers`` (or ``--hf-config num_hidden_layers``) the dry
run builds: the largest shipped models have a few hundred blocks; a million
would build and plan for hours with no output."""


APPLY_BUDGET = 400_000
"""Most (parameter x shard) pairs the dry run simulates with ``fully_shard``
and ``parallelize_module``: both split every parameter into one view per
rank (about 15 us each on a CPU), so a 70B model on dp=1024 would take
minutes. Above the budget FSDP sharding is computed from shapes instead
(the same figures: tests compare the two), and the output says so."""


class UsageError(Exception):
    """Bad command-line input or a model that cannot be planned: one line, exit code 2."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def mp_policy(name: str) -> MixedPrecisionPolicy | None:
    """``--mp``: compute dtype of the policy; gradients reduce in fp32; ``none`` disables mixed precision."""
    if name == "none":
        return None
    dtype = _DTYPES[name]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=dtype)


def _tp_dim(p: torch.Tensor) -> int | None:
    """The tensor dim TP split, read off the DTensor's placement on ``tp``.

    A packed expert weight split per half (``_StridedShard``) counts as
    split along its dim: each rank holds ``1/tp`` of it all the same."""
    if not isinstance(p, DTensor):
        return None
    for name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements):
        if name == "tp" and isinstance(placement, (Shard, StridedShard)):
            return placement.dim
    return None


def param_shards(
    model: nn.Module, p: Plan, dims: ParallelDims, *, fsdp_applied: bool, moe: tuple[int, int] | None = None
) -> dict[str, ParamShard]:
    """Rank 0's shard of every distinct parameter (tied ones once, under the
    name the Plan uses). With FSDP applied, the local DTensor shard is read;
    otherwise FSDP's split is computed from the shape: over ``dims``'s
    shard dims, or for expert units over the MoE mesh's (``moe``: its FSDP
    shard count and ``ep`` size; experts split by expert are divided by
    ``ep`` as well)."""
    owned = p.owned_params
    split = set(p.expert_parallel.params) if p.expert_parallel is not None else set()
    by_id: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        seen = by_id.get(id(tensor))
        if seen is None or (name in owned and seen[0] not in owned):
            by_id[id(tensor)] = (name, tensor)
    out: dict[str, ParamShard] = {}
    for fqn, param in sorted(by_id.values(), key=lambda item: item[0]):
        tp_dim = _tp_dim(param)
        if fsdp_applied:
            local: torch.Tensor = local_tensor(param) if isinstance(param, DTensor) else param
            local_numel = local.numel()
        else:
            shards = dims.dp_shard if fqn in owned else 1
            if moe is not None and fqn in owned and p.units[owned[fqn]].mesh == "moe":
                shards = moe[0] * (moe[1] if fqn in split else 1)
            local_numel = math.prod(local_shape(tuple(param.shape), tp_dim=tp_dim, tp=dims.tp, shards=shards))
        out[fqn] = ParamShard(
            fqn=fqn,
            numel=param.numel(),
            local_numel=local_numel,
            dtype=param.dtype,
            tp_sharded=tp_dim is not None,
            requires_grad=param.requires_grad,
        )
    return out


def _dtype(d: torch.dtype | None) -> str | None:
    return None if d is None else str(d).removeprefix("torch.")


_ROW_FIELDS = (
    "kind",
    "storage_dtype",
    "compute_dtype",
    "bytes_per_rank",
    "padding_bytes_per_rank",
    "gathered_bytes",
    "reshard_after_forward",
    "all_gathers",
    "reduce_scatters",
)


def _rows(units: Sequence[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Units that differ only in a block index and agree in every field a
    row shows collapse into one row (``model.layers.{0..78} (79 units)``);
    one that differs (the last block, which does not reshard) keeps a row
    of its own, and so does a unit spanning several modules
    (``layers.{0..3}.attn.sinks (one unit)``)."""
    by_module: dict[str, dict[str, Any]] = {}
    items: list[tuple[str, tuple[Any, ...]]] = []
    for u in units:
        if len(u["modules"]) == 1:
            by_module[u["modules"][0]] = u
            items.append((u["modules"][0], tuple(u[f] for f in _ROW_FIELDS)))
        else:
            items.append((u["modules"][0], ("one unit", u["index"])))
    rows: list[tuple[str, list[dict[str, Any]]]] = []
    for label, key, names in collapse_keyed(items):
        if key[0] == "one unit":
            u = units[key[1]]
            rows.append((f"{join_names(u['modules'])} (one unit)", [u]))
        else:
            group = [by_module[n] for n in names]
            rows.append((label if len(group) == 1 else f"{label} ({len(group)} units)", group))
    return rows
