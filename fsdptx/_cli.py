"""``python -m fsdptx plan``: a dry-run planner that needs no GPU.

Builds a model skeleton on the meta device (a preset, or a user factory
``package.module:function``), runs the default pipeline, applies the plan on a
fake-process-group mesh (proving it applies: every unit really becomes an FSDP
module), and prints each unit with its dtypes, bytes per rank and the FSDP
collectives one training step issues.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ._apply import apply_plan
from ._plan import Plan, format_plan, summarize_modules
from ._report import UnitTraffic, step_traffic
from ._transforms import (
    compose,
    mark_reduction,
    plan,
    shard_across_blocks,
    shard_by_dtype,
)
from .presets import PRESETS, build_preset

DEFAULT_PIPELINE = compose(shard_by_dtype, shard_across_blocks, mark_reduction)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Mesh axes FSDP does not shard over; every other axis is flattened into the FSDP mesh.
_NON_FSDP_AXES = ("tp", "pp", "ep", "cp")


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"dp=2,tp=4"`` -> ``((2, 4), ("dp", "tp"))``."""
    shape: list[int] = []
    names: list[str] = []
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        if not sep or not name.isidentifier() or not size.isdigit() or int(size) < 1:
            raise UsageError(f"malformed --mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...] such as dp=2,tp=4")
        if name in names:
            raise UsageError(f"malformed --mesh {text!r}: axis {name!r} appears twice")
        names.append(name)
        shape.append(int(size))
    if not any(n not in _NON_FSDP_AXES for n in names):
        raise UsageError(f"--mesh {text!r} has no data-parallel axis to shard over (e.g. dp=8)")
    return tuple(shape), tuple(names)


def load_factory(spec: str) -> Callable[[], nn.Module]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"malformed --factory {spec!r}: expected package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure is the user's factory failing
        raise UsageError(f"cannot import {module_name!r} for --factory: {type(e).__name__}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"--factory {spec!r}: {module_name} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


def build_model(args: argparse.Namespace) -> nn.Module:
    """Construct on the meta device: shapes and dtypes without memory."""
    with torch.device("meta"):
        if args.factory:
            factory = load_factory(args.factory)
            try:
                model = factory()
            except Exception as e:
                raise UsageError(f"--factory {args.factory!r} raised {type(e).__name__}: {e}") from None
        else:
            if args.preset not in PRESETS:
                raise UsageError(f"unknown preset {args.preset!r}; known presets: {', '.join(sorted(PRESETS))}")
            model = build_preset(args.preset, args.layers)
    if not isinstance(model, nn.Module):
        raise UsageError(f"--factory {args.factory!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _fsdp_mesh(mesh: Any, names: tuple[str, ...]) -> Any:
    dp = tuple(n for n in names if n not in _NON_FSDP_AXES)
    if len(dp) == 1:
        return mesh[dp[0]]
    return mesh[dp]._flatten("dp_flat")


def _bytes_per_rank(model: nn.Module, p: Plan) -> list[int]:
    """Exact per-rank shard bytes (rank 0), read off the DTensors after apply."""
    out = []
    for unit in p.units:
        total = 0
        for fqn in unit.params:
            t = model.get_parameter(fqn)
            local = t._local_tensor if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
        out.append(total)
    return out


def report(model_name: str, shape: Sequence[int], names: Sequence[str], p: Plan, per_rank: list[int]) -> dict[str, Any]:
    traffic = step_traffic(p)
    units = []
    for i, (u, t, b) in enumerate(zip(p.units, traffic, per_rank)):
        units.append(
            {
                "index": i,
                "kind": u.kind,
                "modules": list(u.modules),
                "storage_dtype": str(u.storage_dtype).removeprefix("torch.") if u.storage_dtype else None,
                "compute_dtype": str(u.compute_dtype).removeprefix("torch.") if u.compute_dtype else None,
                "params": len(u.params),
                "numel": u.numel,
                "bytes": u.nbytes,
                "bytes_per_rank": b,
                "reshard_after_forward": u.reshard_after_forward,
                "all_gathers": t.all_gathers,
                "reduce_scatters": t.reduce_scatters,
            }
        )
    return {
        "model": model_name,
        "mesh": dict(zip(names, shape)),
        "units": units,
        "step": _totals(traffic),
        "bytes_per_rank": sum(per_rank),
        "tp_replica_reductions": dict(p.reductions),
        "tp_replica_sync_excluded": list(p.exclusions),
    }


def _totals(traffic: Sequence[UnitTraffic]) -> dict[str, int]:
    return {
        "all_gathers": sum(t.all_gathers for t in traffic),
        "reduce_scatters": sum(t.reduce_scatters for t in traffic),
        "all_gather_bytes": sum(t.all_gather_bytes for t in traffic),
        "reduce_scatter_bytes": sum(t.reduce_scatter_bytes for t in traffic),
    }


def render(data: dict[str, Any], p: Plan) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in data["mesh"].items())
    lines = [f"fsdptx plan: {data['model']} on fake mesh ({mesh})", "", format_plan(p), ""]
    header = ("#", "modules", "bytes/rank", "all-gathers", "reduce-scatters")
    rows = [header] + [
        (
            str(u["index"]),
            summarize_modules(tuple(u["modules"])),
            f"{u['bytes_per_rank']:,}",
            str(u["all_gathers"]),
            str(u["reduce_scatters"]),
        )
        for u in data["units"]
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    s = data["step"]
    lines += [
        "",
        f"per training step: {s['all_gathers']} all-gathers ({s['all_gather_bytes']:,} B unsharded), "
        f"{s['reduce_scatters']} reduce-scatters ({s['reduce_scatter_bytes']:,} B unsharded); "
        f"{data['bytes_per_rank']:,} B of parameters per rank",
    ]
    return "\n".join(lines)


def _parser() -> _Parser:
    parser = _Parser(prog="python -m fsdptx", description="fsdptx command line")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("plan", help="dry-run the default pipeline on a meta-device model and a fake mesh")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="mixed", help=f"built-in model: {', '.join(sorted(PRESETS))} (default mixed)")
    src.add_argument("--factory", help="package.module:function returning an nn.Module")
    p.add_argument("--layers", type=int, default=16, help="blocks for a preset (default 16)")
    p.add_argument("--mesh", default="dp=8", help="fake mesh, e.g. dp=8 or dp=2,tp=4 (default dp=8)")
    p.add_argument("--mp", choices=[*_DTYPES, "none"], default="bf16", help="compute dtype of the policy (default bf16)")
    p.add_argument("--json", action="store_true", help="print the same report as JSON")
    return parser


def run_plan(args: argparse.Namespace) -> str:
    from .testing import fake_mesh  # the fake backend is only needed here

    if args.layers < 1:
        raise UsageError(f"--layers must be >= 1, got {args.layers}")
    shape, names = parse_mesh(args.mesh)
    model = build_model(args)
    mp = None if args.mp == "none" else MixedPrecisionPolicy(param_dtype=_DTYPES[args.mp], reduce_dtype=torch.float32)
    p = plan(model, DEFAULT_PIPELINE, mp_policy=mp)
    with fake_mesh(shape, names) as mesh:
        apply_plan(p, model, _fsdp_mesh(mesh, names))
        per_rank = _bytes_per_rank(model, p)
    name = args.factory or args.preset
    data = report(name, shape, names, p, per_rank)
    return json.dumps(data, indent=2) if args.json else render(data, p)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        print(run_plan(args))
    except UsageError as e:
        print(f"fsdptx: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # planning errors: the model cannot be planned as declared
        print(f"fsdptx: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head` closed the pipe: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
