"""``python -m fsdptx``'s command line: its subcommands and options, with
the help each option prints. Parsing errors are :class:`UsageError` errors, so
the command answers them in one line with exit code 2."""

from __future__ import annotations

__all__ = ["build_parser"]


import argparse
from typing import NoReturn


from ..core._meshes import KNOWN_DIMS, MOE_KNOWN_DIMS
from ..presets import PRESETS
from ._common import UsageError, _DTYPES
from ._diff import add_diff_parser
from ._cp import ROTATE_METHODS
from ._fit_dims import CP_MIN_SEQ, CP_SIZES, PP_SIZES
from ._hardware import DEFAULT_GPU, DEFAULT_GPUS_PER_NODE, DEFAULT_MFU, GPUS
from ._pipeline import add_pipeline_arguments
from ._report import OPTIMIZER_STATES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> _Parser:
    """The ``python -m fsdptx`` parser (``plan`` and ``diff``)."""
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
    p.add_argument(
        "--moe-mesh",
        metavar="NAME=SIZE,...",
        help="the experts' view of the same ranks, e.g. dp_shard=2,ep=2: expert modules shard over its "
        "data-parallel axes and, with ep > 1, are split by expert across ep (axes: "
        f"{', '.join(MOE_KNOWN_DIMS)})",
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
        help="optimizer state to count: adamw 2 states, sgd (momentum) 1, none 0, each in the parameters' storage dtype (default adamw)",
    )
    p.add_argument(
        "--batch",
        type=int,
        help="sequences per data-parallel rank: trace one training step for activations and the peak "
        "(default 1 when --seq, --html or --fit is given; without any of them nothing is traced)",
    )
    p.add_argument("--seq", type=int, help="tokens per sequence of the traced step (default 2048)")
    p.add_argument(
        "--offload", action="store_true", help="CPUOffloadPolicy: sharded params, grads and optimizer state on the host"
    )
    p.add_argument(
        "--fit",
        metavar="GPUSxMEMORY",
        help="list the meshes, checkpointing and offload settings whose traced peak fits, e.g. 64x80GiB "
        "(ignores --mesh/--sp/--ac/--offload; traces --batch/--seq)",
    )
    p.add_argument(
        "--ep",
        metavar="SIZES",
        help="with --fit: the expert-parallel sizes its candidates split the experts across (MoE mesh "
        "[dp_replicate x] ep_shard x ep, ep taken from dp_shard x tp): auto (default: 1, and 2, 4, 8 where they "
        "divide the expert counts of a model with experts), N, or a list such as 1,8; 1: experts in their blocks",
    )
    fit = p.add_argument_group(
        "--fit's step-time model", "rank what fits by a predicted step's throughput: a ranking aid, not a measurement"
    )
    fit.add_argument(
        "--headroom",
        metavar="BYTES|PERCENT",
        help="memory per GPU left out of --fit's budget (CUDA context, NCCL buffers, fragmentation), "
        "e.g. 4GiB or 10%% (default 10%%)",
    )
    fit.add_argument("--gpu", help=f"hardware preset: {', '.join(sorted(GPUS))} (default {DEFAULT_GPU})")
    fit.add_argument("--flops", type=float, metavar="TFLOPS", help="dense bf16 peak per GPU in TFLOP/s (overrides --gpu's)")
    fit.add_argument("--nvlink", type=float, metavar="GBPS", help="NVLink GB/s per GPU and direction (overrides --gpu's)")
    fit.add_argument(
        "--network", type=float, metavar="GBPS", help="inter-node network GB/s per GPU and direction (overrides --gpu's)"
    )
    fit.add_argument("--pcie", type=float, metavar="GBPS", help="host link GB/s per GPU and direction (overrides --gpu's)")
    fit.add_argument(
        "--gpus-per-node", type=int, metavar="N", help=f"GPUs sharing a node's NVLink (default {DEFAULT_GPUS_PER_NODE})"
    )
    fit.add_argument("--mfu", type=float, help=f"share of the peak the step reaches, in (0, 1] (default {DEFAULT_MFU:g})")
    fit.add_argument("--top", type=int, metavar="K", help="list only the K best of what fits (default all)")
    fit.add_argument(
        "--fit-cp",
        metavar="SIZES",
        help=f"context-parallel sizes --fit tries besides 1: auto ({', '.join(map(str, CP_SIZES))} from --seq "
        f"{CP_MIN_SEQ} on, none below), 1 (none) or a list such as 2,4",
    )
    fit.add_argument(
        "--fit-pp",
        metavar="SIZES",
        help=f"pipeline sizes --fit tries besides 1, modelled from the traced blocks: auto "
        f"({', '.join(map(str, PP_SIZES))}), 1 (none) or a list such as 2,4; with --schedule 1F1B or GPipe "
        "(default 1F1B) and --microbatches (default --batch: one sequence each)",
    )
    fit.add_argument(
        "--fit-jobs",
        type=int,
        metavar="N",
        help="processes --fit traces its settings in (default: the CPUs this process may use); "
        "the result does not depend on it",
    )
    p.add_argument(
        "--cp-rotate",
        choices=list(ROTATE_METHODS),
        help="with a cp axis > 1 in --mesh and a traced step: how ring attention rotates K/V, as torch's "
        "set_rotate_method (default allgather, torch's): sizes its modelled buffers",
    )
    p.add_argument(
        "--routing-skew",
        metavar="F",
        help="with an ep axis > 1 in --moe-mesh and a traced step: the routing the experts' token dispatch is "
        "traced under, the busiest expert receiving F (>= 1) times the mean tokens (default 1: balanced)",
    )
    p.add_argument("--html", metavar="FILE", help="write a self-contained picture of the traced step to FILE")
    p.add_argument("--json", action="store_true", help="print the same report as JSON (the plan under \"plan\")")
    add_pipeline_arguments(p)
    add_diff_parser(sub)
    return parser
