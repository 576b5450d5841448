"""The ``plan --fit`` command: its options read and checked, the search of
:mod:`fsdptx.cli._fit` run for the command line's model, and the ranked
candidates written as text or JSON with the time model they were ranked by.
The search knows nothing of the command line; this module knows nothing of
how a candidate is evaluated."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from torch import nn

from ..core._sizes import format_bytes
from ._common import UsageError, mp_policy
from ._fit_dims import CP_MIN_SEQ, CP_SIZES, PP_SIZES, parse_ep, parse_sizes
from ._compute_params import compute_params
from ._fit import DEFAULT_HEADROOM, parse_fit, parse_headroom, search
from ._hardware import DEFAULT_GPU, SELECTIVE_RECOMPUTE, hardware
from ._pipeline import fit_schedules
from ._workers import available_cpus

__all__ = ["TIME_MODEL", "run_fit"]


def run_fit(args: Any) -> str:
    """``plan --fit``: the search for the command line's model; text or JSON."""
    from ..manager import FSDP2Config
    from ._run import _batch_seq, build_model

    try:
        gpus, budget = parse_fit(args.fit)
        headroom_text = DEFAULT_HEADROOM if args.headroom is None else args.headroom
        headroom = parse_headroom(headroom_text, budget)
        hw = hardware(
            DEFAULT_GPU if args.gpu is None else args.gpu,
            flops=args.flops,
            nvlink=args.nvlink,
            network=args.network,
            pcie=args.pcie,
            gpus_per_node=args.gpus_per_node,
            mfu=args.mfu,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.top is not None and args.top < 1:
        raise UsageError(f"--top must be >= 1, got {args.top}")
    if args.fit_jobs is not None and args.fit_jobs < 1:
        raise UsageError(f"--fit-jobs must be >= 1, got {args.fit_jobs}")
    batch_seq = _batch_seq(args)
    assert batch_seq is not None  # --fit asks for a trace
    batch, seq = batch_seq
    try:
        cp_sizes = parse_sizes(args.fit_cp or "auto", "--fit-cp", CP_SIZES if seq >= CP_MIN_SEQ else ())
        pp_sizes = parse_sizes(args.fit_pp or "auto", "--fit-pp", PP_SIZES)
        ep_sizes = parse_ep(args.ep or "auto")
    except ValueError as e:
        raise UsageError(str(e)) from None
    model, name = build_model(args)
    layers = _block_count(args, model)

    def build(n: int | None) -> nn.Module:
        if n is None or layers is None:
            return build_model(args)[0]
        if args.hf is not None:
            return build_model(argparse.Namespace(**{**vars(args), "hf_config": [*args.hf_config, f"num_hidden_layers={n}"]}))[0]
        return build_model(argparse.Namespace(**{**vars(args), "layers": n}))[0]

    def config(**kw: Any) -> FSDP2Config:
        return FSDP2Config(mp_policy=mp_policy(args.mp), **kw)

    multiplied = compute_params(model)
    try:
        result = search(
            build,
            layers,
            gpus,
            budget,
            batch=batch,
            seq=seq,
            optimizer=args.optimizer,
            config=config,
            hardware=hw,
            flops_params=multiplied.active,
            headroom=headroom,
            ep_sizes=ep_sizes,
            cp_sizes=cp_sizes,
            pp_sizes=tuple(p for p in pp_sizes if layers is None or p <= layers),
            schedules=fit_schedules(args),
            microbatches=args.microbatches,
            jobs=available_cpus() if args.fit_jobs is None else args.fit_jobs,
        )
        result = dataclasses.replace(
            result,
            candidates=tuple(dataclasses.replace(c, mp=args.mp) for c in result.candidates),
            fitting=tuple(dataclasses.replace(c, mp=args.mp) for c in result.fitting),
        )
    except ValueError as e:
        raise UsageError(f"cannot fit {name}: {' '.join(str(e).split())}") from None
    usable = budget - headroom
    shown = result.fitting[: args.top]
    rejected = []
    for c in sorted(result.candidates, key=lambda c: c.peak_bytes):
        if c not in result.fitting:
            over = f"predicted peak {format_bytes(c.peak_bytes)} over the usable {format_bytes(usable)}"
            rejected.append({**c.to_json(), "rejected_because": over})
    data = {
        "model": name,
        "fit": {
            "gpus": gpus,
            "budget_bytes": budget,
            "headroom_bytes": headroom,
            "usable_bytes": usable,
            "batch": batch,
            "seq": seq,
            "optimizer": args.optimizer,
            "hardware": hw.to_json(),
            "time_model": TIME_MODEL,
            "compute_params": multiplied.to_json(),
            "evaluated": len(result.candidates),
            "fitting_total": len(result.fitting),
            "fitting": [c.to_json() for c in shown],
            "not_fitting": rejected,
            "skipped": list(result.skipped),
        },
    }
    if args.json:
        return json.dumps(data, indent=2)
    lines = [
        f"fsdptx plan --fit: {name} on {gpus} GPUs x {format_bytes(budget)} (usable {format_bytes(usable)}: "
        f"--headroom {headroom_text} = {format_bytes(headroom)} for the CUDA context, NCCL buffers and "
        f"fragmentation), batch {batch} x seq {seq} per data-parallel rank: {len(result.fitting)} of "
        f"{len(result.candidates)} configurations fit, best first by predicted tokens per second per GPU",
        f"hardware: {hw.text()} (--gpu, --flops, --nvlink, --network, --pcie, --gpus-per-node, --mfu)",
        f"time model, a ranking aid and not a measurement: {TIME_MODEL}",
    ]
    if multiplied.note:
        lines.append(
            f"compute counts N = {multiplied.active:,} of the {multiplied.total:,} parameters that multiply: "
            f"{multiplied.note}"
        )
    for i, c in enumerate(shown, 1):
        comm = ", ".join(f"{k} {format_bytes(v)}" for k, v in c.comm_bytes.items() if v)
        t = c.predicted
        links = ", ".join(f"{dim} {link}" for dim, link in t.links.items())
        lines.append(
            f"{i:3}. {' '.join(c.cli_args()[:4 if c.ep > 1 else 2])}{_pipeline_text(c)}  ac={c.activation_checkpointing or 'off'}  offload={'on' if c.offload else 'off'}"
            f"  peak {format_bytes(c.peak_bytes)}  predicted {_ms(t.total)} per step, {t.tokens_per_s:,.0f} tokens/s per GPU"
        )
        lines.append(
            f"     compute {_ms(t.compute)}, TP comm {_ms(t.tp)}, DP comm {_ms(t.dp)} ({_ms(t.dp_exposed)} exposed), "
            f"{f'CP comm {_ms(t.cp)}, ' if t.cp else ''}{f'PP comm {_ms(t.pp)}, bubble {_ms(t.bubble)}, ' if c.schedule else ''}"
            f"offload {_ms(t.offload)}; comm {format_bytes(c.comm_total)} ({comm or 'none'}){f'; {links}' if links else ''}"
        )
        lines.append(f"     {c.config_text()}  # python -m fsdptx plan <model options> {' '.join(c.cli_args())}")
    if len(shown) < len(result.fitting):
        lines.append(f"... {len(result.fitting) - len(shown)} more fit (--top {args.top} shows the first)")
    lines += [f"skipped {s}" for s in result.skipped]
    if any(c.schedule is not None for c in result.candidates):
        lines.append(
            "(pipeline candidates are modelled from the traced blocks, not traced per stage: each stage's parameters, "
            "gradients and optimizer state exact, its units gathered for the step, its blocks' activations for the "
            "micro-batches in flight, the traced transient peak at the whole batch; plan one with its options for a "
            "traced step per stage)"
        )
    if any(c.mesh.get("cp", 1) > 1 for c in result.candidates):
        lines.append(
            "(cp candidates are traced at seq/cp with ring attention's allgather K/V buffers modelled, not traced: "
            "torch's ring attention has no CPU path)"
        )
    if any(c.extrapolated for c in result.candidates):
        lines.append(
            f"(peaks, activations and TP traffic traced at {result.traced_blocks[0]} and {result.traced_blocks[-1]} "
            "blocks and extrapolated linearly; parameters, gradients and optimizer state are exact)"
        )
    return "\n".join(lines)


TIME_MODEL = (
    "compute = 6N FLOPs per token (N: the parameters a token's matmuls multiply, routed experts at top_k / num_experts; "
    "+ 2N full checkpointing, "
    f"+ {2 * SELECTIVE_RECOMPUTE:g}N selective) x batch x seq / (tp x cp x pp stages) over flops x mfu; TP collectives exposed; "
    "FSDP/HSDP collectives overlap compute (only what exceeds it counts); offload host copies exposed at PCIe "
    "(the host optimizer step not counted); CP ring and PP point-to-point traffic exposed; the pipeline bubble "
    "(pp - 1) / microbatches of the compute; a dim's collectives take NVLink when its groups lie inside a node, "
    "else the network; ranked by tokens per second per GPU (batch x seq / (tp x cp x pp) per step), as --batch is per "
    "data-parallel rank and candidates train different global batches"
)
"""The rule :mod:`fsdptx.cli._hardware` predicts by, as the output states it."""


def _pipeline_text(c: Any) -> str:
    if c.schedule is None:
        return ""
    if c.stages_per_rank > 1:
        return f" {c.schedule} ({c.stages_per_rank} stages per rank) x {c.microbatches} micro-batches (peak pp rank {c.peak_stage})"
    return f" {c.schedule} x {c.microbatches} micro-batches (peak stage {c.peak_stage})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _block_count(args: Any, model: nn.Module) -> int | None:
    """Blocks of the command line's model when the command line can change
    them (a preset's ``--layers``, an ``--hf`` model's ``num_hidden_layers``)."""
    if args.factory is not None:
        return None
    if args.hf is not None:
        n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        return n if isinstance(n, int) else None
    return 16 if args.layers is None else int(args.layers)
