"""Pieces the dry run's modules share: the usage error, byte formatting,
rows of repeated units, rank 0's parameter shards and the CLI's bounds."""

from __future__ import annotations


import argparse
import dataclasses
import importlib
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..apply._apply import apply_plan
from ..core._meshes import KNOWN_DIMS, ParallelDims
from ..plan._types import Plan, Unit, _format_requests, reshards_after_forward
from ..plan._json import plan_document
from ._report import OPTIMIZER_STATES, MemoryPlan, ParamShard, UnitTraffic, local_shape, memory_plan, step_traffic
from ..plan._transforms import compose, mark_reduction, shard_across_blocks, shard_by_dtype
from ..presets import PRESETS, build_preset


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


_DP_DIMS = tuple(n for n in KNOWN_DIMS if n not in ("tp", "pp"))


MAX_WORLD = 65536


# The largest --layers (or --hf-config num_hidden_layers) the dry run builds:
# the largest shipped models have a few hundred blocks; a million would
# build and plan for hours with no output.
MAX_LAYERS = 4096
"""Largest fake world the dry run builds. Beyond it the mesh alone takes
gigabytes and minutes; no real job is that large either."""


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
        if name == "tp" and isinstance(placement, (Shard, _StridedShard)):
            return placement.dim
    return None


def param_shards(model: nn.Module, p: Plan, dims: ParallelDims, *, fsdp_applied: bool) -> dict[str, ParamShard]:
    """Rank 0's shard of every distinct parameter (tied ones once, under the
    name the Plan uses). With FSDP applied, the local DTensor shard is read;
    otherwise FSDP's split is computed from the shape."""
    owned = p.owned_params
    by_id: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        seen = by_id.get(id(tensor))
        if seen is None or (name in owned and seen[0] not in owned):
            by_id[id(tensor)] = (name, tensor)
    out: dict[str, ParamShard] = {}
    for fqn, param in sorted(by_id.values(), key=lambda item: item[0]):
        tp_dim = _tp_dim(param)
        if fsdp_applied:
            local: torch.Tensor = param._local_tensor if isinstance(param, DTensor) else param
            local_numel = local.numel()
        else:
            shards = dims.dp_shard if fqn in owned else 1
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


def fmt_bytes(n: float) -> str:
    """GiB / MiB / KiB with two significant decimals, B below 1 KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2,5"``."""
    parts: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def collapse_fqns(fqns: Sequence[str]) -> str:
    """``model.layers.0`` .. ``model.layers.79`` -> ``model.layers.{0..79}``:
    FQNs that differ in one index become one name with the indices braced."""
    if len(fqns) == 1:
        return fqns[0] or "<root>"
    patterns = {_INDEX.sub("*", f) for f in fqns}
    if len(patterns) == 1:
        pattern = patterns.pop()
        if pattern.count("*") == 1:
            indices = sorted(int(_INDEX.findall(f)[0]) for f in fqns)
            return pattern.replace("*", "{" + _ranges(indices) + "}")
        return f"{pattern} ({len(fqns)} modules)"
    return f"{fqns[0]} +{len(fqns) - 1} more"


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
    """Units that differ only in a block index collapse into one row
    (``model.layers.{0..78} x79``); one that differs (the last block, which
    does not reshard) keeps a row of its own."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for u in units:
        pattern = _INDEX.sub("*", "|".join(u["modules"])) if len(u["modules"]) == 1 else u["index"]
        key = (pattern, *(u[f] for f in _ROW_FIELDS))
        groups.setdefault(key, []).append(u)
    rows = []
    for group in groups.values():
        if len(group) == 1:
            u = group[0]
            label = collapse_fqns(u["modules"])
            rows.append((label if len(u["modules"]) == 1 else f"{label} (one unit)", group))
        else:
            rows.append((f"{collapse_fqns([u['modules'][0] for u in group])} x{len(group)}", group))
    return rows
