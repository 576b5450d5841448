"""``python -m fsdptx plan``: a dry run of :class:`fsdptx.FSDP2Manager` that needs no GPU.

Builds a model skeleton on the meta device (a preset, a user factory
``package.module:function``, or any installed Hugging Face architecture),
plans it with ``FSDP2Manager(FSDP2Config(...), mesh).plan(model)``, applies
that plan with ``parallelize`` on a fake-process-group mesh (proving it
applies: TP styles, checkpointing, every FSDP unit and prefetch chain), and
prints one table of units, the TP / checkpointing / prefetch requests, the
FSDP collectives of one step and a per-rank memory plan (see
:class:`fsdptx.cli._report.MemoryPlan` for what it counts; with
``--batch``/``--seq`` also a traced step, :mod:`fsdptx.cli._memory`).

Every mistake on the command line, in a factory or in a model's
declarations is reported as one line on stderr with exit code 2.
"""

from __future__ import annotations


import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from ..core._names import join_names
from ..core._sizes import format_bytes
from ..plan._json import plan_document
from ..plan._compose import compose
from ..plan.transforms import mark_reduction, shard_across_blocks, shard_by_dtype
from ..plan._format import format_requests, fp32_input_casts
from ..plan._plan import Plan
from ..plan._types import reshards_after_forward
from ._common import UsageError, _dtype, _one_line, _rows, mp_policy
from ._diff import PlanFileError, run_diff
from ._cp import cp_seq_error
from ._ep import check_routing_skew
from ._memory import disable_kv_cache, memory_json, memory_text
from ._pipeline import pipeline_config, run_pipeline_plan
from ._report import OPTIMIZER_STATES, PAD_FLAG_RATIO, MemoryPlan, UnitTraffic, memory_plan, step_traffic
from ._options import build_parser
from ._run import DryRun, _batch_seq, build_model, dry_run, parse_mesh, parse_moe_mesh

# The pipeline of plain ``fsdptx.plan`` (no manager): kept for callers that
# compare against it; the CLI itself runs the manager's pipeline.
DEFAULT_PIPELINE = compose(shard_by_dtype, shard_across_blocks, mark_reduction)


def report(name: str, shape: Sequence[int], names: Sequence[str], run: DryRun, optimizer: str) -> dict[str, Any]:
    """The whole report as JSON-ready data; :func:`render` prints the same figures."""
    p, dims = run.plan, run.dims
    moe = run.moe
    mem = memory_plan(
        p,
        run.shards,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        optimizer=optimizer,
        moe_shard=None if moe is None else moe.shard,
        ep=1 if moe is None else moe.ep,
    )
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
                "padding_flagged": m.padding_ratio > PAD_FLAG_RATIO,
                "gathered_bytes": m.gathered,
                "reduce_scatter_input_bytes": m.reduce_input,
                "reshard_after_forward": reshards_after_forward(u),
                "all_gathers": t.all_gathers,
                "reduce_scatters": t.reduce_scatters,
            }
        )
    largest = None if mem.largest_unit is None else units[mem.largest_unit]
    data: dict[str, Any] = {
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
        "moe_mesh": None if moe is None else {"mesh": moe.mesh, "ep": moe.ep, "expert_fsdp_shard": moe.shard},
        "expert_bytes_per_rank": sum(
            s.local_numel * s.dtype.itemsize for f, s in run.shards.items() if f in _expert_params(p)
        ),
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
            "peak_forward_at": mem.forward_at or None,  # None: no unit is gathered
            "peak_backward_bytes": mem.peak_backward,
            "peak_backward_gathered_bytes": mem.backward_gathered,
            "peak_backward_at": mem.backward_at or None,
        },
        "tp_replica_reductions": dict(p.reductions) if dims.tp > 1 else {},
        "tp_replica_sync_excluded": list(p.exclusions) if dims.tp > 1 else [],
    }
    if run.trace is not None:
        data["memory"].update(memory_json(run.trace, run.shards, optimizer))
    return data


def _expert_params(p: Plan) -> set[str]:
    """Parameters of the units on the MoE mesh."""
    return {f for u in p.units if u.mesh == "moe" for f in u.params}


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
        parts.append(
            "one data-parallel rank: the FSDP units shard nothing, they apply the policy"
            if data["units"]
            else "no FSDP sharding (one data-parallel rank)"
        )
    if d["cp"] > 1:
        parts.append(f"cp={d['cp']} folded into the shard dim, each CP rank holding seq/{d['cp']} of every activation")
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


def _moe_lines(data: dict[str, Any]) -> list[str]:
    """What ``--moe-mesh`` does to the experts, when given."""
    moe = data["moe_mesh"]
    if moe is None:
        return []
    mesh = ", ".join(f"{k}={v}" for k, v in moe["mesh"].items())
    split = f"split by expert across ep={moe['ep']}, then " if moe["ep"] > 1 else ""
    return [f"experts on the MoE mesh {mesh}: {split}FSDP over {moe['expert_fsdp_shard']} ranks"]


def _applied_line(data: dict[str, Any]) -> str:
    moe = data["moe_mesh"]
    if data["applied"] == "full" and moe is not None and moe["ep"] > 1 and data["memory"].get("expert_parallel"):
        return (
            "applied with apply_plan on the fake mesh, expert weights split across ep and, for the traced step, "
            "a token dispatch of fixed sizes (the routing assumed below); bytes per rank are rank 0's DTensor shards"
        )
    if data["applied"] == "full" and moe is not None and moe["ep"] > 1:
        return (
            "applied with apply_plan on the fake mesh, expert weights split across ep but the model's token "
            "dispatch not set up (the dry run runs no forward through the experts); bytes per rank are rank 0's "
            "DTensor shards"
        )
    return _APPLIED[data["applied"]]


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
        *_moe_lines(data),
        _applied_line(data),
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
                    format_bytes(u["bytes_per_rank"]),
                    cell,
                    format_bytes(u["gathered_bytes"]),
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
            lines.append(f"(!) shards padded by more than {PAD_FLAG_RATIO:.0%}: dim 0 is small or not divisible by the shard count")
    else:
        lines.append("no FSDP units")
    casts = fp32_input_casts(p)
    if casts:
        lines.append(f"fp32 input casts: {join_names(casts)} (wholly fp32 modules in a lower-precision model)")
    lines += format_requests(p)
    if data["tp_replica_reductions"]:
        counts: dict[str, int] = {}
        for r in data["tp_replica_reductions"].values():
            counts[r] = counts.get(r, 0) + 1
        lines.append(
            "tp-replica reductions: " + ", ".join(f"{n} {r}" for r, n in sorted(counts.items()))
            + " (unmarked replicated params: mean)"
        )
    if data["tp_replica_sync_excluded"]:
        lines.append("excluded from tp-replica sync: " + join_names(data["tp_replica_sync_excluded"]))
    s = data["step"]
    lines += [
        "",
        f"per training step (FSDP, per rank): {s['all_gathers']} all-gathers producing "
        f"{format_bytes(s['all_gather_bytes'])}, {s['reduce_scatters']} reduce-scatters consuming "
        f"{format_bytes(s['reduce_scatter_bytes'])}; TP collectives move activations and are not counted",
        "",
    ]
    lines += _memory_lines(data)
    return "\n".join(lines)


def _memory_lines(data: dict[str, Any]) -> list[str]:
    m, d = data["memory"], data["dims"]
    split = d["dp_shard"] * (d["tp"] if d["tp"] > 1 else 1)
    params = f"{format_bytes(m['params_bytes'])} ({m['params_bytes']:,} B"
    moe = data["moe_mesh"]
    if moe is not None:  # experts and dense params split differently
        experts = data["expert_bytes_per_rank"]
        params += (
            f" of {data['model_bytes']:,} B: experts {experts:,} B, split over ep={moe['ep']} x "
            f"{moe['expert_fsdp_shard']} shards; the rest over {split} ranks"
        )
    elif d["tp"] == 1:
        params += f" = {data['model_bytes']:,} B / {d['dp_shard']} shards"
    else:  # TP-replicated params (norms) split over dp_shard only
        params += f" of {data['model_bytes']:,} B over {split} ranks"
    params += f" + {m['padding_bytes']:,} B padding)"
    states = OPTIMIZER_STATES[m["optimizer"]]
    rows = [
        ("parameters", params),
        ("gradients", format_bytes(m["grads_bytes"])),
        (f"optimizer ({m['optimizer']}, {states} states in the parameters' dtype)", format_bytes(m["optimizer_bytes"])),
    ]
    largest = m["largest_gathered_unit"]
    if largest is not None:
        label = join_names(largest["modules"])
        rows.append(("largest all-gathered unit", f"{format_bytes(largest['bytes'])} ({label})"))
    for phase in ("forward", "backward"):
        at = m[f"peak_{phase}_at"]
        rows.append(
            (
                f"peak {phase}",
                f"{format_bytes(m[f'peak_{phase}_bytes'])} (+ {format_bytes(m[f'peak_{phase}_gathered_bytes'])} gathered"
                + (f", worst at {at})" if at else ")"),
            )
        )
    width = max(len(k) for k, _ in rows)
    traced = "peak_bytes" in m
    counted = "from shapes; the traced step below adds activations" if traced else "activations not counted: add --batch/--seq for them"
    out = [f"memory per rank (rank 0; {counted}):"]
    out += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return out + memory_text(m) if traced else out


_FIT_ONLY = ("headroom", "gpu", "flops", "nvlink", "network", "pcie", "gpus_per_node", "mfu", "top", "fit_cp", "fit_pp", "fit_jobs")


def run_plan(args: argparse.Namespace) -> str:
    from ..manager import FSDP2Config

    if args.fit is not None:
        from ._fit_command import run_fit

        if args.html is not None:
            raise UsageError(
                "--html draws one traced step and --fit evaluates many configurations; pick one from the "
                "--fit list and run plan with its options and --html FILE"
            )
        pipeline_config(args, None)  # refuses the pipeline options --fit does not search
        if args.cp_rotate is not None:
            raise UsageError(
                "--fit traces its cp candidates with torch's default allgather rotation; plan one cp mesh with --cp-rotate"
            )
        if args.routing_skew is not None:
            raise UsageError(
                "--routing-skew sizes the experts' token dispatch of one traced step, which --fit does not "
                "trace; plan one of its candidates with --moe-mesh and --routing-skew F"
            )
        if args.moe_mesh is not None:
            raise UsageError(
                "--fit derives each candidate's MoE mesh itself and would ignore --moe-mesh; use --ep N to "
                "split the experts across N ranks in every candidate (--ep 1,2,4 to try several)"
            )

        return run_fit(args)
    if args.ep not in (None, "1"):
        raise UsageError("--ep applies to --fit; for one mesh give --moe-mesh with an ep axis")
    given = [f"--{k.replace('_', '-')}" for k in _FIT_ONLY if getattr(args, k) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} apply to --fit (they rank its candidates by a predicted step time)")
    shape, names = parse_mesh(args.mesh)
    pipeline = pipeline_config(args, names)
    batch_seq = _batch_seq(args)
    _check_cp(args, dict(zip(names, shape)), batch_seq)
    moe = None if args.moe_mesh is None else parse_moe_mesh(args.moe_mesh, math.prod(shape))
    skew = _routing_skew(args.routing_skew, moe, batch_seq, pipeline is not None)
    model, name = build_model(args)
    config = FSDP2Config(
        sequence_parallel=args.sp,
        loss_parallel=args.loss_parallel,
        blocks=tuple(b.strip() for b in args.blocks.split(",") if b.strip()) if args.blocks else None,
        mp_policy=mp_policy(args.mp),
        activation_checkpointing=args.ac or False,
        offload_policy=CPUOffloadPolicy() if args.offload else None,
        pipeline_parallel=pipeline,
    )
    if batch_seq is not None and config.checkpoint_mode is not None:
        disable_kv_cache(model)  # as a training run with checkpointing must
    if batch_seq is not None and args.offload:  # traced without it, then left out of the peak (estimate_from_trace)
        config = dataclasses.replace(config, offload_policy=None)
    if pipeline is not None:
        return run_pipeline_plan(args, model, name, shape, names, config, batch_seq, report)
    try:
        run = dry_run(
            model,
            shape,
            names,
            config,
            batch_seq=batch_seq,
            moe=moe,
            cp_rotate=args.cp_rotate or "allgather",
            routing_skew=skew,
        )
    except ValueError as e:  # the planner's own message names what to change
        raise UsageError(f"cannot plan {name}: {_one_line(e)}") from None
    except TypeError as e:  # typically a declaration of the wrong type (_no_split_modules = 5)
        raise UsageError(
            f"cannot plan {name}: TypeError: {_one_line(e)}; check the model's declarations "
            "(_no_split_modules, _keep_in_fp32_modules(_strict), _tp_plan, _fsdp_shard_across_blocks)"
        ) from None
    if run.trace is not None and args.offload:
        run = dataclasses.replace(run, trace=dataclasses.replace(run.trace, offloaded=True))
    data = report(name, shape, names, run, args.optimizer)
    if args.html is not None:
        from ._html import write_html

        write_html(args.html, data, run)
    if args.json:
        return json.dumps({**data, "plan": plan_document(run.plan)}, indent=2)
    return render(data, run.plan)


def _check_cp(args: argparse.Namespace, mesh: dict[str, int], batch_seq: tuple[int, int] | None) -> None:
    """Refuse, before anything is built, a traced CP step that cannot be
    sized: ``--seq`` that the ``2 x cp`` head-tail chunks (and SP's ``tp``)
    do not divide, and ``--cp-rotate`` with nothing to size."""
    cp = mesh.get("cp", 1)
    if args.cp_rotate is not None and (cp == 1 or batch_seq is None):
        raise UsageError(
            "--cp-rotate sizes ring attention's buffers in a traced step: it needs a cp axis > 1 in --mesh "
            "and --batch/--seq"
        )
    if cp == 1 or batch_seq is None:
        return
    error = cp_seq_error(batch_seq[1], cp, mesh.get("tp", 1), args.sp)
    if error is not None:
        raise UsageError(f"--seq {batch_seq[1]} with cp={cp}: {error}")


def _routing_skew(
    text: str | None,
    moe: tuple[tuple[int, ...], tuple[str, ...]] | None,
    batch_seq: tuple[int, int] | None,
    pipelined: bool,
) -> float:
    """``--routing-skew`` as a number (1.0 when not given), refused before
    anything is built when it is not one >= 1 or there is no traced step
    with experts split across ``ep`` > 1 for it to size."""
    if text is None:
        return 1.0
    try:
        skew = check_routing_skew(float(text), "--routing-skew")
    except (ValueError, TypeError):
        raise UsageError(
            f"--routing-skew must be a number >= 1 (1 = balanced; F = the busiest expert receives F times the "
            f"mean tokens), got {text!r}"
        ) from None
    ep = 1 if moe is None else dict(zip(moe[1], moe[0])).get("ep", 1)
    if ep <= 1 or batch_seq is None or pipelined:
        raise UsageError(
            "--routing-skew sizes the experts' token dispatch in a traced step: it needs an ep axis > 1 in "
            "--moe-mesh and --batch/--seq (without pipeline stages)"
        )
    return skew


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, or 2 with one line on stderr)."""
    try:
        args = build_parser().parse_args(argv)
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
