"""The hardware model ``plan --fit`` ranks by, and the step time it predicts.

Bytes alone rank badly: a byte over PCIe to the host costs about seven
NVLink bytes, and a byte that overlaps compute costs nothing. So each
fitting candidate gets a predicted step time under a stated model of one
GPU and its links. It is a ranking aid, not a measurement: it orders
candidates the way their largest costs order them and says what those are.

The rule, per rank and step:

- compute: FLOPs (the 6N rule, :func:`step_flops`) over ``flops x mfu``;
- TP collectives: exposed (they sit between the matmuls of every block);
- FSDP / HSDP collectives: overlapped with compute (FSDP2 prefetches the
  next unit's all-gather and reduces a unit's gradients while the next one
  computes), so only what exceeds the compute shows;
- offload host copies: exposed, at PCIe (the host optimizer step itself is
  not counted: offload's figure is a lower bound);
- context parallelism's ring K/V rotation and pipeline stages'
  point-to-point activations: exposed (an upper bound: ring attention and
  the schedules overlap part of them with compute);
- the pipeline bubble: ``(pp - 1) / (v x microbatches)`` of the compute
  (Narayanan et al., 2021), idle time every stage waits.

Each collective moves its bytes at the bandwidth of the link its mesh dim
crosses (:func:`link_of`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["GPUS", "Hardware", "StepTime", "hardware", "link_of", "predict", "step_flops"]

DEFAULT_GPU = "h100"
DEFAULT_MFU = 0.4
"""Share of the peak the matmuls reach: 0.4 is what well-tuned dense
training of large models reports on H100s (torchtitan, Megatron papers
report 0.35-0.55)."""
DEFAULT_GPUS_PER_NODE = 8

SELECTIVE_RECOMPUTE = 0.1
"""Selective checkpointing keeps every matmul's and attention's output and
recomputes the elementwise ops, norms and activations between them: no
matmul FLOPs, but memory-bound time, counted as a tenth of a forward."""

_TERA = 1e12
_GIGA = 1e9


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links, as spec sheets give them.

    ``flops`` is the dense bf16 peak in FLOP/s; ``nvlink``, ``network`` and
    ``pcie`` are bytes per second per GPU in one direction (NVLink inside a
    node, the GPU's share of the inter-node network, the host link);
    ``mfu`` the share of the peak the step reaches.
    """

    name: str
    flops: float
    nvlink: float
    network: float
    pcie: float
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    mfu: float = DEFAULT_MFU

    def __post_init__(self) -> None:
        for field in ("flops", "nvlink", "network", "pcie"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"hardware {self.name}: {field} must be a positive number, got {value!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name}: gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        if not (isinstance(self.mfu, (int, float)) and 0 < self.mfu <= 1):
            raise ValueError(f"hardware {self.name}: mfu must be in (0, 1], got {self.mfu!r}")

    def text(self) -> str:
        return (
            f"{self.name}: {self.flops / _TERA:g} TFLOP/s dense bf16 x mfu {self.mfu:g}, NVLink "
            f"{self.nvlink / _GIGA:g} GB/s, network {self.network / _GIGA:g} GB/s per GPU, PCIe "
            f"{self.pcie / _GIGA:g} GB/s, {self.gpus_per_node} GPUs per node"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "flops_per_s": self.flops,
            "nvlink_bytes_per_s": self.nvlink,
            "network_bytes_per_s": self.network,
            "pcie_bytes_per_s": self.pcie,
            "gpus_per_node": self.gpus_per_node,
            "mfu": self.mfu,
        }


GPUS: dict[str, Hardware] = {
    # SXM parts from NVIDIA's data sheets; network: one 200 Gb/s (A100) or
    # 400 Gb/s (H100 onwards) InfiniBand NIC per GPU, as DGX / HGX nodes have.
    "a100": Hardware("a100", 312 * _TERA, 300 * _GIGA, 25 * _GIGA, 32 * _GIGA),  # PCIe gen4 x16
    "h100": Hardware("h100", 989 * _TERA, 450 * _GIGA, 50 * _GIGA, 64 * _GIGA),  # PCIe gen5 x16
    "h200": Hardware("h200", 989 * _TERA, 450 * _GIGA, 50 * _GIGA, 64 * _GIGA),  # H100's compute, more memory
    "b200": Hardware("b200", 2250 * _TERA, 900 * _GIGA, 50 * _GIGA, 64 * _GIGA),
}


def hardware(
    gpu: str,
    *,
    flops: float | None = None,
    nvlink: float | None = None,
    network: float | None = None,
    pcie: float | None = None,
    gpus_per_node: int | None = None,
    mfu: float | None = None,
) -> Hardware:
    """The preset ``gpu`` with any given figure replacing its own
    (``flops`` in TFLOP/s, the links in GB/s, as the command line takes them).

    Raises:
        ValueError: an unknown ``gpu`` (naming the known ones), or a figure
            that is not positive (``mfu`` above 1).
    """
    if gpu not in GPUS:
        raise ValueError(
            f"unknown --gpu {gpu!r}; known: {', '.join(sorted(GPUS))} (override its figures with "
            "--flops/--nvlink/--network/--pcie)"
        )
    base = GPUS[gpu]
    changes: dict[str, Any] = {}
    for field, value, unit in (
        ("flops", flops, _TERA),
        ("nvlink", nvlink, _GIGA),
        ("network", network, _GIGA),
        ("pcie", pcie, _GIGA),
    ):
        if value is not None:
            changes[field] = value * unit
    if gpus_per_node is not None:
        changes["gpus_per_node"] = gpus_per_node
    if mfu is not None:
        changes["mfu"] = mfu
    if set(changes) & {"flops", "nvlink", "network", "pcie"}:
        changes["name"] = f"{base.name} (overridden)"
    return dataclasses.replace(base, **changes)


def step_flops(matmul_params: int, tokens: int, ac: str | bool) -> float:
    """FLOPs of one training step over ``tokens`` tokens by the 6N rule:
    2N per token forward, 4N backward, plus what checkpointing recomputes
    (full: one more forward; selective: :data:`SELECTIVE_RECOMPUTE` of one).
    Attention's score matmuls (which grow with the sequence) are not
    counted: the same for every candidate of a search."""
    forwards = {False: 0.0, "selective": SELECTIVE_RECOMPUTE, "full": 1.0}[ac]
    return (6 + 2 * forwards) * matmul_params * tokens


def link_of(mesh: Mapping[str, int], dim: str, gpus_per_node: int) -> str:
    """``"nvlink"`` when every group of ``dim`` lies inside one node, else
    ``"network"``.

    Ranks are laid out as the mesh lists its dims, the last innermost
    (``tp``: neighbouring ranks), nodes hold ``gpus_per_node`` consecutive
    ranks. A group of ``dim`` then spans the ranks of ``dim`` and every dim
    inside it; it stays in one node when that span fits in a node and
    divides it (so no group straddles two), or the whole world is one node.
    """
    names = list(mesh)
    span = math.prod(mesh[n] for n in names[names.index(dim) :])
    world = math.prod(mesh.values())
    if world <= gpus_per_node or (span <= gpus_per_node and gpus_per_node % span == 0):
        return "nvlink"
    return "network"


_DIM_OF = {
    "tp": "tp",
    "cp_ring": "cp",
    "pp_p2p": "pp",
    "fsdp_all_gather": "dp_shard",
    "fsdp_reduce_scatter": "dp_shard",
    "hsdp_all_reduce": "dp_replicate",
}
_HOST = "offload_host_copies"


@dataclass(frozen=True)
class StepTime:
    """One candidate's predicted step in seconds: ``compute``, ``tp`` and
    ``dp`` communication (``dp`` overlaps compute, so ``total`` counts only
    what exceeds it), ``offload`` host copies, ``cp`` ring and ``pp``
    point-to-point traffic, the pipeline ``bubble``, and the link each mesh
    dim's collectives take; ``tokens`` is what the step trains per GPU.

    Candidates of one world train different global batches (``--batch`` is
    per data-parallel rank, and TP makes fewer of them), so they compare by
    :attr:`tokens_per_s`, not by ``total``."""

    compute: float
    tp: float
    dp: float
    offload: float
    links: dict[str, str]
    tokens: float
    cp: float = 0.0
    pp: float = 0.0
    bubble: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens trained per second per GPU."""
        return self.tokens / self.total if self.total > 0 else math.inf

    @property
    def dp_exposed(self) -> float:
        return max(0.0, self.dp - self.compute)

    @property
    def total(self) -> float:
        return max(self.compute, self.dp) + self.tp + self.cp + self.pp + self.bubble + self.offload

    def to_json(self) -> dict[str, Any]:
        return {
            "compute_ms": self.compute * 1e3,
            "tp_comm_ms": self.tp * 1e3,
            "dp_comm_ms": self.dp * 1e3,
            "dp_comm_exposed_ms": self.dp_exposed * 1e3,
            "offload_ms": self.offload * 1e3,
            "cp_comm_ms": self.cp * 1e3,
            "pp_comm_ms": self.pp * 1e3,
            "pipeline_bubble_ms": self.bubble * 1e3,
            "total_ms": self.total * 1e3,
            "tokens_per_gpu": self.tokens,
            "tokens_per_s_per_gpu": self.tokens_per_s,
            "links": self.links,
        }


def predict(
    mesh: Mapping[str, int],
    comm_bytes: Mapping[str, int],
    flops: float,
    hw: Hardware,
    *,
    tokens: float,
    bubble: float = 0.0,
) -> StepTime:
    """The step time of one rank doing ``flops`` and moving ``comm_bytes``
    (per kind, as :class:`fsdptx.cli._fit.Candidate` counts them) on
    ``mesh``, training ``tokens`` per GPU; ``bubble`` is the pipeline's idle
    share relative to the compute (0 without stages).

    Raises:
        ValueError: a kind of communication with no known link, or bytes
            on a dim the mesh does not have.
    """
    if not (math.isfinite(bubble) and bubble >= 0):
        raise ValueError(f"the pipeline bubble must be a finite number >= 0, got {bubble!r}")
    seconds = {"tp": 0.0, "dp": 0.0, "cp": 0.0, "pp": 0.0}
    links: dict[str, str] = {}
    offload = 0.0
    for kind, nbytes in comm_bytes.items():
        if kind == _HOST:
            offload += nbytes / hw.pcie
            continue
        if kind not in _DIM_OF:
            raise ValueError(f"no link known for communication {kind!r}; known: {', '.join([*_DIM_OF, _HOST])}")
        if nbytes == 0:
            continue  # no group of that dim (or nothing to send): no link to name
        dim = _DIM_OF[kind]
        if dim not in mesh:
            raise ValueError(f"{nbytes:,} bytes of {kind} on a mesh without {dim}: {dict(mesh)}")
        links[dim] = link_of(mesh, dim, hw.gpus_per_node)
        bandwidth = hw.nvlink if links[dim] == "nvlink" else hw.network
        seconds[dim if dim in ("tp", "cp", "pp") else "dp"] += nbytes / bandwidth
    compute = flops / (hw.flops * hw.mfu)
    return StepTime(
        compute, seconds["tp"], seconds["dp"], offload, links, tokens, seconds["cp"], seconds["pp"], compute * bubble
    )
