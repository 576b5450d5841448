"""``python -m fsdptx plan``: a dry run of :class:`fsdptx.FSDP2Manager` that needs no GPU.

Builds a model skeleton on the meta device (a preset, a user factory
``package.module:function``, or any installed Hugging Face architecture),
plans it with ``FSDP2Manager(FSDP2Config(...), mesh).plan(model)``, applies
that plan with ``parallelize`` on a fake-process-group mesh (proving it
applies: TP styles, checkpointing, every FSDP unit and prefetch chain), and
prints one table of units, the TP / checkpointing / prefetch requests, the
FSDP collectives of one step and a per-rank memory plan (see
:class:`fsdptx.cli._report.MemoryPlan` for what it counts).

Every mistake on the command line, in a factory or in a model's
declarations is reported as one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
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
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from ..apply._apply import apply_plan
from ..core._meshes import KNOWN_DIMS, ParallelDims
from ..plan._types import Plan, Unit, _format_requests, reshards_after_forward
from ._diff import PlanFileError, add_diff_parser, run_diff
from ..plan._json import plan_document
from ._report import OPTIMIZER_STATES, MemoryPlan, ParamShard, UnitTraffic, local_shape, memory_plan, step_traffic
from ..plan._transforms import compose, mark_reduction, shard_across_blocks, shard_by_dtype
from ..presets import PRESETS, build_preset

# The pipeline of plain ``fsdptx.plan`` (no manager): kept for callers that
# compare against it; the CLI itself runs the manager's pipeline.
DEFAULT_PIPELINE = compose(shard_by_dtype, shard_across_blocks, mark_reduction)
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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


# --------------------------------------------------------------------------- parsing


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"dp=2,tp=4"`` -> ``((2, 4), ("dp", "tp"))``, refusing meshes larger
    than :data:`MAX_WORLD` ranks before anything is built."""
    shape: list[int] = []
    names: list[str] = []
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        # ASCII digits only: "²".isdigit() is True, but int("²") fails.
        if not sep or not name.isidentifier() or not (size.isascii() and size.isdigit()) or int(size) < 1:
            raise UsageError(f"malformed --mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...] such as dp=2,tp=4")
        if name in names:
            raise UsageError(f"malformed --mesh {text!r}: axis {name!r} appears twice")
        if name not in KNOWN_DIMS:
            raise UsageError(f"--mesh {text!r}: unknown axis {name!r}; name each axis one of {', '.join(KNOWN_DIMS)}")
        names.append(name)
        shape.append(int(size))
    world = math.prod(shape)
    if world > MAX_WORLD:
        raise UsageError(f"--mesh {text!r} has {world:,} ranks; the dry run simulates at most {MAX_WORLD:,}")
    if not any(n in _DP_DIMS for n in names):
        raise UsageError(
            f"--mesh {text!r} has no data-parallel axis ({', '.join(_DP_DIMS)}); add dp=1 for tensor parallelism alone"
        )
    return tuple(shape), tuple(names)


def _parse_value(text: str) -> object:
    """``--hf-config`` values: int, then float, then true/false, else the string."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    return text


def parse_hf_config(items: Sequence[str]) -> dict[str, object]:
    """``["num_hidden_layers=2,hidden_size=64"]`` -> ``{"num_hidden_layers": 2, "hidden_size": 64}``."""
    out: dict[str, object] = {}
    for text in items:
        for item in text.split(","):
            key, sep, value = item.strip().partition("=")
            if not sep or not key.isidentifier() or not value:
                raise UsageError(f"malformed --hf-config {text!r}: expected KEY=VALUE[,KEY=VALUE...]")
            out[key] = _parse_value(value)
    return out


# --------------------------------------------------------------------------- the model


def _exited(what: str, e: SystemExit) -> UsageError:
    return UsageError(f"{what} called sys.exit({e.code!r}); it must return an nn.Module instead of exiting")


def load_factory(spec: str) -> Callable[[], nn.Module]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"malformed --factory {spec!r}: expected package.module:function")
    try:
        module = importlib.import_module(module_name)
    except SystemExit as e:
        raise _exited(f"importing {module_name!r} for --factory", e) from None
    except Exception as e:  # any import-time failure is the user's factory failing
        raise UsageError(f"cannot import {module_name!r} for --factory: {type(e).__name__}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"--factory {spec!r}: {module_name} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


def _build_hf(args: argparse.Namespace) -> nn.Module:
    from ..hf import build_hf_model

    overrides = parse_hf_config(args.hf_config)
    layers = overrides.get("num_hidden_layers")
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise UsageError(f"--hf-config num_hidden_layers must be at most {MAX_LAYERS:,}, got {layers:,}")
    dtype = _DTYPES[args.dtype or "bf16"]
    try:
        return build_hf_model(args.hf, overrides, dtype=dtype, device="meta")
    except ImportError as e:
        raise UsageError(str(e)) from None
    except SystemExit as e:
        raise _exited(f"building --hf {args.hf!r}", e) from None
    except Exception as e:  # unknown type, bad override: the config's own message says which
        raise UsageError(f"cannot build --hf {args.hf!r}: {type(e).__name__}: {_one_line(e)}") from None


def build_model(args: argparse.Namespace) -> tuple[nn.Module, str]:
    """Construct on the meta device (shapes and dtypes without memory);
    returns the model and the name the report shows."""
    if args.hf is None and args.hf_config:
        raise UsageError("--hf-config needs --hf MODEL_TYPE (or --hf path/to/config.json)")
    if args.hf is None and args.dtype is not None:
        raise UsageError("--dtype applies to --hf models; presets and factories choose their own dtypes")
    if args.layers is not None and (args.hf or args.factory):
        raise UsageError("--layers applies to presets; for --hf use --hf-config num_hidden_layers=N")
    if args.hf is not None:
        model = _build_hf(args)
        return model, f"{args.hf} ({type(model).__name__}, {args.dtype or 'bf16'})"
    with torch.device("meta"):
        if args.factory:
            factory = load_factory(args.factory)
            try:
                model = factory()
            except SystemExit as e:
                raise _exited(f"--factory {args.factory!r}", e) from None
            except Exception as e:
                raise UsageError(f"--factory {args.factory!r} raised {type(e).__name__}: {_one_line(e)}") from None
            if not isinstance(model, nn.Module):
                raise UsageError(f"--factory {args.factory!r} returned {type(model).__name__}, not an nn.Module")
            return model, args.factory
        preset = args.preset or "mixed"
        layers = 16 if args.layers is None else args.layers
        if preset not in PRESETS:
            raise UsageError(f"unknown preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}")
        if not 1 <= layers <= MAX_LAYERS:
            raise UsageError(f"--layers must be between 1 and {MAX_LAYERS:,}, got {layers:,}")
        return build_preset(preset, layers), f"{preset} (preset, {layers} layers)"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def mp_policy(name: str) -> MixedPrecisionPolicy | None:
    """``--mp``: compute dtype of the policy; gradients reduce in fp32; ``none`` disables mixed precision."""
    if name == "none":
        return None
    dtype = _DTYPES[name]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=dtype)


# --------------------------------------------------------------------------- dry run


@dataclass(frozen=True)
class DryRun:
    """What the dry run produced: the Plan, each parameter's rank-0 shard,
    and how it got them (``applied``: ``"full"`` when ``parallelize`` ran,
    ``"tp"`` when only TP was applied and FSDP shards were computed from
    shapes, ``"none"`` when nothing needed applying)."""

    plan: Plan
    dims: ParallelDims
    shards: dict[str, ParamShard]
    applied: str
    params: int


def _tp_dim(p: torch.Tensor) -> int | None:
    """The tensor dim TP split, read off the DTensor's placement on ``tp``."""
    if not isinstance(p, DTensor):
        return None
    for name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements):
        if name == "tp" and isinstance(placement, Shard):
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


def dry_run(model: nn.Module, shape: tuple[int, ...], names: tuple[str, ...], config: Any) -> DryRun:
    """Plan with the manager and apply on a fake mesh (within :data:`APPLY_BUDGET`)."""
    from ..manager import FSDP2Manager
    from ..testing import fake_mesh  # the fake backend is only needed here

    n_params = sum(1 for _ in model.parameters())
    with fake_mesh(shape, names) as mesh:
        manager = FSDP2Manager(config, mesh)
        dims = manager.dims
        p = manager.plan(model)
        tp_cost = n_params * (dims.tp if dims.tp > 1 else 0)
        fsdp_cost = n_params * (dims.dp_shard if p.units else 0)
        if tp_cost + fsdp_cost <= APPLY_BUDGET:
            manager.parallelize(model)
            applied = "full" if (p.units or p.tensor_parallel) else "none"
        elif tp_cost <= APPLY_BUDGET:
            # TP alone (and checkpointing, marks): the FSDP split is computed from shapes.
            apply_plan(p.replace(units=(), prefetch=(), reduce_unused_params=False), model, mesh)
            applied = "tp" if p.tensor_parallel else "computed"
        else:
            raise UsageError(
                f"tp={dims.tp} over {n_params:,} parameters is more than the dry run simulates "
                f"({APPLY_BUDGET:,} parameter shards); use a smaller tp"
            )
        shards = param_shards(model, p, dims, fsdp_applied=applied == "full")
    return DryRun(plan=p, dims=dims, shards=shards, applied=applied, params=n_params)


# --------------------------------------------------------------------------- report


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


def _unit_label(unit: Unit) -> str:
    label = collapse_fqns(unit.modules)
    return label if len(unit.modules) == 1 else f"{label} (one unit)"


def report(name: str, shape: Sequence[int], names: Sequence[str], run: DryRun, optimizer: str) -> dict[str, Any]:
    """The whole report as JSON-ready data; :func:`render` prints the same figures."""
    p, dims = run.plan, run.dims
    mem = memory_plan(p, run.shards, dp_shard=dims.dp_shard, tp=dims.tp, optimizer=optimizer)
    traffic = step_traffic(p)
    units = []
    for i, (u, t, m) in enumerate(zip(p.units, traffic, mem.units)):
        units.append(
            {
                "index": i,
                "kind": u.kind,
                "modules": list(u.modules),
                "storage_dtype": _dtype(u.storage_dtype),
                "compute_dtype": _dtype(u.compute_dtype),
                "params": len(u.params),
                "numel": u.numel,
                "bytes": u.nbytes,
                "bytes_per_rank": m.params,
                "padding_bytes_per_rank": m.padding,
                "padding_flagged": m.padding_ratio > 0.25,
                "gathered_bytes": m.gathered,
                "reduce_scatter_input_bytes": m.reduce_input,
                "reshard_after_forward": reshards_after_forward(u),
                "all_gathers": t.all_gathers,
                "reduce_scatters": t.reduce_scatters,
            }
        )
    largest = None if mem.largest_unit is None else units[mem.largest_unit]
    return {
        "warnings": list(p.warnings),
        "model": name,
        "mesh": dict(zip(names, shape)),
        "world_size": math.prod(shape),
        "dims": {
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "cp": dims.cp,
            "tp": dims.tp,
            "pp": dims.pp,
        },
        "applied": run.applied,
        "mp_policy": _policy_json(p.mp_policy),
        "model_bytes": sum(s.numel * s.dtype.itemsize for s in run.shards.values()),
        "units": units,
        "rows": [{"label": label, "units": [u["index"] for u in group]} for label, group in _rows(units)],
        "step": _step(traffic, mem),
        "bytes_per_rank": mem.params,
        "memory": {
            "params_bytes": mem.params,
            "params_unpadded_bytes": mem.params_ideal,
            "padding_bytes": mem.padding,
            "grads_bytes": mem.grads,
            "optimizer": optimizer,
            "optimizer_bytes": mem.optimizer,
            "largest_gathered_unit": (
                None if largest is None else {"modules": largest["modules"], "bytes": mem.largest_gathered}
            ),
            "peak_forward_bytes": mem.peak_forward,
            "peak_forward_gathered_bytes": mem.forward_gathered,
            "peak_forward_at": mem.forward_at,
            "peak_backward_bytes": mem.peak_backward,
            "peak_backward_gathered_bytes": mem.backward_gathered,
            "peak_backward_at": mem.backward_at,
        },
        "tp_replica_reductions": dict(p.reductions) if dims.tp > 1 else {},
        "tp_replica_sync_excluded": list(p.exclusions) if dims.tp > 1 else [],
    }


def _policy_json(policy: MixedPrecisionPolicy | None) -> dict[str, str | None] | None:
    if policy is None:
        return None
    return {"param_dtype": _dtype(policy.param_dtype), "reduce_dtype": _dtype(policy.reduce_dtype)}


def _step(traffic: Sequence[UnitTraffic], mem: MemoryPlan) -> dict[str, int]:
    return {
        "all_gathers": sum(t.all_gathers for t in traffic),
        "reduce_scatters": sum(t.reduce_scatters for t in traffic),
        "all_gather_bytes": sum(t.all_gathers * m.gathered for t, m in zip(traffic, mem.units)),
        "reduce_scatter_bytes": sum(t.reduce_scatters * m.reduce_input for t, m in zip(traffic, mem.units)),
    }


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


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _mesh_line(data: dict[str, Any]) -> str:
    d = data["dims"]
    parts = []
    if d["dp_replicate"] > 1 and d["dp_shard"] == 1:
        parts.append(f"replicated over dp_replicate={d['dp_replicate']} (whole parameters on every rank)")
    elif d["dp_replicate"] > 1:
        parts.append(f"HSDP: replicated over dp_replicate={d['dp_replicate']}, sharded over {d['dp_shard']} ranks")
    elif d["dp_shard"] > 1:
        parts.append(f"FSDP shards over {d['dp_shard']} ranks")
    else:
        parts.append("no FSDP sharding (one data-parallel rank)")
    if d["cp"] > 1:
        parts.append(f"cp={d['cp']} folded into the shard dim")
    if d["tp"] > 1:
        parts.append(f"TP over {d['tp']} ranks")
    if d["pp"] > 1:
        parts.append(f"pp={d['pp']} (nothing reshards)")
    policy = data["mp_policy"]
    if policy is None:
        mp = "mixed precision off"
    else:
        mp = f"compute {policy['param_dtype']}, reduce {policy['reduce_dtype']}"
    return "; ".join(parts) + f"; {mp}"


_APPLIED = {
    "full": "applied with FSDP2Manager.parallelize on the fake mesh; bytes per rank are rank 0's DTensor shards",
    "tp": (
        "TP applied on the fake mesh; FSDP shards computed from shapes (simulating fully_shard over this many "
        "ranks would take minutes)"
    ),
    "computed": (
        "FSDP shards computed from shapes, not applied (simulating fully_shard over this many ranks would take "
        "minutes)"
    ),
    "none": "nothing to apply (no TP, one data-parallel rank)",
}


def render(data: dict[str, Any], p: Plan) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in data["mesh"].items())
    lines = [f"warning: {w}" for w in data["warnings"]] + [
        f"fsdptx plan: {data['model']} on a fake mesh {mesh} ({data['world_size']} ranks)",
        _mesh_line(data),
        _APPLIED[data["applied"]],
        "",
    ]
    units = data["units"]
    if units:
        header = ("kind", "units", "storage->compute", "reshard", "params/rank", "pad", "gathered", "AG", "RS")
        table = [header]
        flagged = False
        for label, group in _rows(units):
            u = group[0]
            pad = u["padding_bytes_per_rank"]
            ideal = u["bytes_per_rank"] - pad
            cell = "-" if pad == 0 else f"+{100 * pad / ideal:.0f}%" if ideal else "+inf"
            if u["padding_flagged"]:
                cell += " (!)"
                flagged = True
            table.append(
                (
                    u["kind"],
                    label,
                    f"{u['storage_dtype']}->{u['compute_dtype']}",
                    str(u["reshard_after_forward"]),
                    fmt_bytes(u["bytes_per_rank"]),
                    cell,
                    fmt_bytes(u["gathered_bytes"]),
                    str(u["all_gathers"]),
                    str(u["reduce_scatters"]),
                )
            )
        lines += _table(table)
        lines.append(
            "(per unit: params/rank = rank 0's shard incl. padding; gathered = the all-gather output in the "
            "compute dtype; AG/RS = all-gathers/reduce-scatters per step)"
        )
        if flagged:
            lines.append("(!) shards padded by more than 25%: dim 0 is small or not divisible by the shard count")
    else:
        lines.append("no FSDP units")
    lines += _format_requests(p)
    if data["tp_replica_reductions"]:
        counts: dict[str, int] = {}
        for r in data["tp_replica_reductions"].values():
            counts[r] = counts.get(r, 0) + 1
        lines.append(
            "tp-replica reductions: " + ", ".join(f"{n} {r}" for r, n in sorted(counts.items()))
            + " (unmarked replicated params: mean)"
        )
    if data["tp_replica_sync_excluded"]:
        lines.append("excluded from tp-replica sync: " + ", ".join(data["tp_replica_sync_excluded"]))
    s = data["step"]
    lines += [
        "",
        f"per training step (FSDP, per rank): {s['all_gathers']} all-gathers producing "
        f"{fmt_bytes(s['all_gather_bytes'])}, {s['reduce_scatters']} reduce-scatters consuming "
        f"{fmt_bytes(s['reduce_scatter_bytes'])}; TP collectives move activations and are not counted",
        "",
    ]
    lines += _memory_lines(data)
    return "\n".join(lines)


def _memory_lines(data: dict[str, Any]) -> list[str]:
    m, d = data["memory"], data["dims"]
    split = d["dp_shard"] * (d["tp"] if d["tp"] > 1 else 1)
    params = f"{fmt_bytes(m['params_bytes'])} ({m['params_bytes']:,} B"
    if d["tp"] == 1:
        params += f" = {data['model_bytes']:,} B / {d['dp_shard']} shards"
    else:  # TP-replicated params (norms) split over dp_shard only
        params += f" of {data['model_bytes']:,} B over {split} ranks"
    params += f" + {m['padding_bytes']:,} B padding)"
    states = OPTIMIZER_STATES[m["optimizer"]]
    rows = [
        ("parameters", params),
        ("gradients", fmt_bytes(m["grads_bytes"])),
        (f"optimizer ({m['optimizer']}, {states} fp32 states)", fmt_bytes(m["optimizer_bytes"])),
    ]
    largest = m["largest_gathered_unit"]
    if largest is not None:
        label = collapse_fqns(largest["modules"])
        rows.append(("largest all-gathered unit", f"{fmt_bytes(largest['bytes'])} ({label})"))
    for phase in ("forward", "backward"):
        at = m[f"peak_{phase}_at"]
        rows.append(
            (
                f"peak {phase}",
                f"{fmt_bytes(m[f'peak_{phase}_bytes'])} (+ {fmt_bytes(m[f'peak_{phase}_gathered_bytes'])} gathered"
                + (f", worst at {at})" if at else ")"),
            )
        )
    width = max(len(k) for k, _ in rows)
    out = ["memory per rank (rank 0; activations not counted, see fsdptx.cli._report.MemoryPlan):"]
    out += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return out


# --------------------------------------------------------------------------- entry point


def _parser() -> _Parser:
    parser = _Parser(prog="python -m fsdptx", description="fsdptx command line")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("plan", help="dry-run FSDP2Manager on a meta-device model and a fake mesh")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help=f"built-in model: {', '.join(sorted(PRESETS))} (default mixed)")
    src.add_argument("--factory", help="package.module:function returning an nn.Module")
    src.add_argument("--hf", metavar="MODEL_TYPE|CONFIG", help="a transformers model type or a local config.json")
    p.add_argument("--hf-config", action="append", default=[], metavar="K=V,...", help="config overrides for --hf")
    p.add_argument(
        "--dtype", choices=list(_DTYPES), help="storage dtype of an --hf model, as loading gives it (default bf16)"
    )
    p.add_argument("--layers", type=int, help="blocks for a preset (default 16)")
    p.add_argument(
        "--mesh",
        default="dp=8",
        help=f"fake mesh, e.g. dp=8, dp=2,tp=4, dp_replicate=2,dp_shard=4 (axes: {', '.join(KNOWN_DIMS)})",
    )
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with a tp axis)")
    p.add_argument(
        "--loss-parallel", action="store_true", help="keep the head's logits vocabulary-sharded (with a tp axis)"
    )
    p.add_argument(
        "--blocks", metavar="NAMES", help="the model's blocks: class names or globs, comma-separated (default: declared or found by shape)"
    )
    p.add_argument("--ac", choices=["full", "selective"], help="activation checkpointing of the blocks")
    p.add_argument(
        "--mp",
        choices=[*_DTYPES, "none"],
        default="bf16",
        help="compute dtype of the policy; none disables mixed precision (default bf16)",
    )
    p.add_argument(
        "--optimizer",
        choices=list(OPTIMIZER_STATES),
        default="adamw",
        help="optimizer state to count: adamw 2 fp32 states, sgd (momentum) 1, none 0 (default adamw)",
    )
    p.add_argument("--json", action="store_true", help="print the same report as JSON (the plan under \"plan\")")
    add_diff_parser(sub)
    return parser


def run_plan(args: argparse.Namespace) -> str:
    from ..manager import FSDP2Config

    shape, names = parse_mesh(args.mesh)
    model, name = build_model(args)
    config = FSDP2Config(
        sequence_parallel=args.sp,
        loss_parallel=args.loss_parallel,
        blocks=tuple(b.strip() for b in args.blocks.split(",") if b.strip()) if args.blocks else None,
        mp_policy=mp_policy(args.mp),
        activation_checkpointing=args.ac or False,
    )
    try:
        run = dry_run(model, shape, names, config)
    except ValueError as e:  # the planner's own message names what to change
        raise UsageError(f"cannot plan {name}: {_one_line(e)}") from None
    except TypeError as e:  # typically a declaration of the wrong type (_no_split_modules = 5)
        raise UsageError(
            f"cannot plan {name}: TypeError: {_one_line(e)}; check the model's declarations "
            "(_no_split_modules, _keep_in_fp32_modules(_strict), _tp_plan, _fsdp_shard_across_blocks)"
        ) from None
    data = report(name, shape, names, run, args.optimizer)
    if args.json:
        return json.dumps({**data, "plan": plan_document(run.plan)}, indent=2)
    return render(data, run.plan)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, or 2 with one line on stderr)."""
    try:
        args = _parser().parse_args(argv)
    except UsageError as e:
        print(f"fsdptx: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help printed its text
        return e.code if isinstance(e.code, int) else 0
    try:
        if args.command == "diff":
            text, code = run_diff(args)
            print(text)
            return code
        print(run_plan(args))
    except (UsageError, PlanFileError) as e:
        print(f"fsdptx: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except SystemExit as e:  # model code exited while it was planned or applied: never silently
        print(f"fsdptx: error: the model code called sys.exit({e.code!r}) during the dry run", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head` closed the pipe: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
