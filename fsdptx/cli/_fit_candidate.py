"""What ``plan --fit`` proposes: a candidate parallelization with its
predicted memory, traffic and step, the search's result, and the budget
the command line gives (``--fit GPUSxMEMORY``, ``--headroom``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._hardware import Hardware, StepTime

__all__ = ["AC_MODES", "DEFAULT_HEADROOM", "Candidate", "FitResult", "parse_fit", "parse_headroom", "rank"]

_SIZES = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZES.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_FIT = re.compile(r"^\s*(\d+)\s*x\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*$", re.IGNORECASE)
AC_MODES: tuple[str | bool, ...] = (False, "selective", "full")
_RECOMPUTE = {False: 0, "selective": 1, "full": 2}
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*$", re.IGNORECASE)

DEFAULT_HEADROOM = "10%"
"""Memory per GPU the search leaves out of the budget: the CUDA context
(0.5-1 GiB), NCCL's communicator buffers and the caching allocator's
fragmentation, none of which the traced step holds; 10% of 80 GiB is 8 GiB."""


def parse_headroom(text: str, budget: int) -> int:
    """``--headroom``: ``"10%"`` of ``budget`` or bytes such as ``"4GiB"``, in bytes.

    Raises:
        ValueError: naming the text: not a percentage or a size, or leaving
            no memory of ``budget``.
    """
    if (m := _PERCENT.match(text)) is not None:
        headroom = int(budget * float(m.group(1)) / 100)
    elif (m := _BYTES.match(text)) is not None:
        headroom = int(float(m.group(1)) * _SIZES[m.group(2).upper()])
    elif text.strip() == "0":
        headroom = 0
    else:
        raise ValueError(f"malformed --headroom {text!r}: expected a percentage such as 10% or a size such as 4GiB")
    if headroom >= budget:
        raise ValueError(f"--headroom {text!r} leaves nothing of the {budget:,} bytes per GPU that --fit gives")
    return headroom


def parse_fit(text: str) -> tuple[int, int]:
    """``"64x80GiB"`` -> ``(64, 85899345920)``: GPUs and bytes of memory each.

    Raises:
        ValueError: naming the text and what is wrong: not of the form, no
            GPU, more GPUs than the dry run simulates (``MAX_WORLD``), or
            less than one byte of memory.
    """
    from ._common import MAX_WORLD

    m = _FIT.match(text)
    if m is None:
        raise ValueError(f"malformed --fit {text!r}: expected GPUSxMEMORY such as 64x80GiB or 8x40GB")
    gpus, memory = int(m.group(1)), int(float(m.group(2)) * _SIZES[m.group(3).upper()])
    if gpus < 1:
        raise ValueError(f"--fit {text!r}: the number of GPUs must be at least 1")
    if gpus > MAX_WORLD:
        raise ValueError(f"--fit {text!r} has {gpus:,} GPUs; the dry run simulates at most {MAX_WORLD:,} ranks")
    if memory < 1:
        raise ValueError(f"--fit {text!r}: the memory per GPU must be at least 1 byte, e.g. 80GiB")
    return gpus, memory


@dataclass(frozen=True)
class Candidate:
    """One parallelization: its mesh, checkpointing and offload, what it is
    predicted to hold per rank at its peak, and what it communicates."""

    mesh: dict[str, int]
    activation_checkpointing: str | bool
    offload: bool
    peak_bytes: int
    activations_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    comm_bytes: dict[str, int]
    extrapolated: bool
    mp: str = "bf16"  # the dry run's --mp: bf16 is FSDP2Config's default policy
    ep: int = 1  # experts split across this many ranks (--fit --ep)
    step: StepTime | None = None  # predicted by the search's hardware model
    schedule: str | None = None  # with a pp dim: the pipeline schedule
    microbatches: int = 1  # with a pp dim: micro-batches per step
    peak_stage: int | None = None  # with a pp dim: the pp rank that peaks (modelled); one stage each: that stage
    stages_per_rank: int = 1  # with a pp dim: the schedule's stages per rank

    @property
    def predicted(self) -> StepTime:
        if self.step is None:
            raise ValueError(f"--mesh {self.mesh_arg}: no step time predicted")
        return self.step

    @property
    def comm_total(self) -> int:
        return sum(self.comm_bytes.values())

    @property
    def mesh_arg(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.mesh.items())

    @property
    def sequence_parallel(self) -> bool:
        """Every candidate with TP splits the sequence too (the traces are of
        SP steps)."""
        return self.mesh.get("tp", 1) > 1

    @property
    def moe_mesh(self) -> dict[str, int] | None:
        """The experts' mesh under ``--ep``: the dense mesh's replicate dim,
        then its shard and TP ranks regrouped as ``ep_shard x ep``."""
        if self.ep == 1:
            return None
        rep = self.mesh.get("dp_replicate", 1)
        shard = self.mesh["dp_shard"] * self.mesh.get("tp", 1) // self.ep
        return {**({"dp_replicate": rep} if rep > 1 else {}), "ep_shard": shard, "ep": self.ep}

    def config_text(self) -> str:
        """The ``FSDP2Config`` that reproduces this candidate (beside the
        dry run's mixed-precision policy)."""
        parts = []
        if self.sequence_parallel:
            parts.append("sequence_parallel=True")
        if self.schedule is not None:
            parts.append(
                f"pipeline_parallel=PipelineParallelConfig(schedule={self.schedule!r}, microbatches={self.microbatches}"
                + (f", stages_per_rank={self.stages_per_rank})" if self.stages_per_rank > 1 else ")")
            )
        if self.activation_checkpointing:
            parts.append(f"activation_checkpointing={self.activation_checkpointing!r}")
        if self.offload:
            parts.append("offload_policy=CPUOffloadPolicy()")
        if self.mp == "none":
            parts.append("mp_policy=None")
        elif self.mp != "bf16":
            dtype = {"fp16": "float16", "fp32": "float32"}[self.mp]
            parts.append(
                f"mp_policy=MixedPrecisionPolicy(param_dtype=torch.{dtype}, reduce_dtype=torch.float32, "
                f"output_dtype=torch.{dtype})"
            )
        config = f"FSDP2Config({', '.join(parts)})"
        moe = self.moe_mesh
        if moe is None:
            return config
        return f"{config}, moe_mesh=init_device_mesh(..., {tuple(moe.values())}, mesh_dim_names={tuple(moe)})"

    def cli_args(self) -> list[str]:
        """``python -m fsdptx plan`` options that re-plan this candidate."""
        args = ["--mesh", self.mesh_arg]
        moe = self.moe_mesh
        if moe is not None:
            args += ["--moe-mesh", ",".join(f"{k}={v}" for k, v in moe.items())]
        if self.sequence_parallel:
            args.append("--sp")
        if self.schedule is not None:
            args += ["--schedule", self.schedule, "--microbatches", str(self.microbatches)]
            if self.stages_per_rank > 1:
                args += ["--stages-per-rank", str(self.stages_per_rank)]
        if self.activation_checkpointing:
            args += ["--ac", str(self.activation_checkpointing)]
        if self.offload:
            args.append("--offload")
        if self.mp != "bf16":
            args += ["--mp", self.mp]
        return args

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh,
            "moe_mesh": self.moe_mesh,
            "activation_checkpointing": self.activation_checkpointing or None,
            "offload": self.offload,
            "peak_bytes": self.peak_bytes,
            "activations_bytes": self.activations_bytes,
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "comm_bytes": self.comm_bytes,
            "comm_total_bytes": self.comm_total,
            "predicted_step": None if self.step is None else self.step.to_json(),
            "extrapolated": self.extrapolated,
            "pipeline": None
            if self.schedule is None
            else {
                "schedule": self.schedule,
                "microbatches": self.microbatches,
                "stages_per_rank": self.stages_per_rank,
                "peak_stage": self.peak_stage if self.stages_per_rank == 1 else None,
                "peak_pp_rank": self.peak_stage,
                "modelled": True,
            },
            "config": self.config_text(),
            "argv": self.cli_args(),
        }


@dataclass(frozen=True)
class FitResult:
    """All candidates evaluated, and those that fit within ``budget`` less
    ``headroom``, best first."""

    gpus: int
    budget: int
    headroom: int
    hardware: Hardware
    candidates: tuple[Candidate, ...]
    fitting: tuple[Candidate, ...]
    skipped: tuple[str, ...]
    traced_blocks: tuple[int, ...] = ()  # the block counts the steps were traced at


def rank(candidates: Sequence[Candidate], budget: int) -> tuple[Candidate, ...]:
    """Those within ``budget``, best first: the most tokens per second per
    GPU the predicted step gives (candidates train different global
    batches, so step times alone do not compare), then (on a tie) least
    recompute, no offload, least communication and the smallest peak.

    Raises:
        ValueError: a candidate without a predicted step time.
    """
    fitting = [c for c in candidates if c.peak_bytes <= budget]
    return tuple(
        sorted(
            fitting,
            key=lambda c: (
                -c.predicted.tokens_per_s,
                _RECOMPUTE[c.activation_checkpointing],
                c.offload,
                c.comm_total,
                c.peak_bytes,
            ),
        )
    )
