"""Reading a device mesh by its dim names: which submesh FSDP shards over,
which one tensor parallelism uses, and what pipeline parallelism changes.

Names follow the convention torchtitan and NeMo share: ``dp_replicate`` and
``dp_shard`` (or plain ``dp``) are data parallel, ``cp`` is context parallel
and is folded into the shard dim (CP ranks hold different tokens of the same
samples, so they must also hold different parameter shards to reduce their
gradients together), ``tp`` is tensor parallel, ``pp`` is pipeline parallel.
Already flattened names (``dp_shard_cp``, ``dp_cp``) are accepted too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from ._torch_internals import flatten_mesh, unflatten_mesh

__all__ = [
    "EP_DIM",
    "KNOWN_DIMS",
    "MOE_DP_DIMS",
    "MOE_KNOWN_DIMS",
    "ParallelDims",
    "ep_mesh",
    "ep_size",
    "fsdp_mesh",
    "moe_dp_dims",
    "moe_fsdp_mesh",
    "moe_gradient_divide_factor",
    "parallel_dims",
    "tp_mesh",
    "unit_dp_mesh",
]

_SHARD_DIMS = ("dp_shard", "dp", "dp_shard_cp", "dp_cp", "cp")
KNOWN_DIMS = ("dp_replicate", *_SHARD_DIMS, "tp", "pp")
# Data-parallel dims of a MoE mesh; ``ep`` (expert parallel) is not one:
# experts are split across it on their expert dim, and the model sends each
# token to the rank holding its expert.
MOE_DP_DIMS = ("ep_replicate", "ep_shard", "dp_replicate", "dp_shard", "dp", "dp_shard_cp", "dp_cp", "cp")
# The MoE mesh's data-parallel dims that replicate experts (HSDP's dim 0);
# the others shard them.
_MOE_REPLICATE_DIMS = ("ep_replicate", "dp_replicate")
EP_DIM = "ep"
MOE_KNOWN_DIMS = (*MOE_DP_DIMS, EP_DIM, "tp", "pp")
_MOE_FLAT_SHARD = "moe_dp_shard"
_MOE_FLAT_REPLICATE = "moe_dp_replicate"
_FLAT_SHARD = "dp_shard_cp"
_REPLICATE_ONLY_SHARD = "dp_shard"  # the size-1 shard dim of a replicate-only mesh


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallelism in a mesh, by role (1 where absent)."""

    dp_replicate: int
    dp_shard: int  # data-parallel shard size, cp folded in
    cp: int
    tp: int
    pp: int

    @property
    def fsdp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def sharding_enabled(self) -> bool:
        """Whether more than one rank holds the same layer: on a single
        data-parallel rank FSDP has nothing to shard (it may still be
        planned to apply a policy: see ``FSDP2Manager._plans_units``)."""
        return self.fsdp_size > 1


def _names(mesh: DeviceMesh, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} must be a torch DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"{what} has {mesh.ndim} unnamed dims; name them (init_device_mesh(..., mesh_dim_names=...)) "
                f"with {', '.join(known)}"
            )
        return ("dp",)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"{what} has dim(s) {unknown} fsdptx does not know; name each dim one of {', '.join(known)}"
        )
    return tuple(names)


def _refuse_two_shard_names(names: tuple[str, ...]) -> None:
    """``dp`` and ``dp_shard`` name the same role; a mesh with both is
    ambiguous (is ``dp`` meant as replication?), and folding both into one
    shard dim silently would shard over ranks the user may have meant to
    replicate over."""
    if "dp" in names and "dp_shard" in names:
        raise ValueError(
            f"device_mesh has both 'dp' and 'dp_shard' dims {names}: ambiguous; name the dim FSDP "
            "shards over 'dp_shard' and a replicated one 'dp_replicate' (or use 'dp' alone)"
        )


def parallel_dims(mesh: DeviceMesh) -> ParallelDims:
    """The role sizes of ``mesh``; an unknown dim name is a ``ValueError``."""
    names = _names(mesh, KNOWN_DIMS, "device_mesh")
    _refuse_two_shard_names(names)
    size = dict(zip(names, mesh.shape))
    shard = math.prod(size[n] for n in names if n in _SHARD_DIMS)
    return ParallelDims(
        dp_replicate=size.get("dp_replicate", 1),
        dp_shard=shard,
        cp=size.get("cp", 1),
        tp=size.get("tp", 1),
        pp=size.get("pp", 1),
    )


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``fully_shard`` uses: the shard dims (``cp`` folded in,
    flattened into one when there are several), preceded by ``dp_replicate``
    when present (a 2-D mesh: HSDP, replicate across dim 0, shard across 1).

    A mesh whose only data-parallel dim is ``dp_replicate`` replicates: it
    becomes HSDP with a shard dim of size 1, so every rank holds whole
    parameters (DDP semantics), not a 1-D mesh FSDP would shard over."""
    names = _names(mesh, KNOWN_DIMS, "device_mesh")
    if mesh.mesh_dim_names is None:
        return mesh
    _refuse_two_shard_names(names)
    shard = tuple(n for n in names if n in _SHARD_DIMS)
    replicate = ("dp_replicate",) if "dp_replicate" in names else ()
    if not shard and not replicate:
        return unit_dp_mesh(mesh)
    if not shard:
        sub = mesh if names == replicate else mesh["dp_replicate"]
        return unflatten_mesh(sub, 0, (sub.size(), 1), ("dp_replicate", _REPLICATE_ONLY_SHARD))
    if len(shard) > 1:
        flat = flatten_mesh(mesh[shard], _FLAT_SHARD)
        if not replicate:
            return flat  # kept as returned: torch deprecates slicing a flattened dim from the root
        shard = (_FLAT_SHARD,)
    dims = replicate + shard
    if dims == tuple(names):
        return mesh
    return mesh[dims[0]] if len(dims) == 1 else mesh[dims]


def unit_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A data-parallel mesh of one rank for a mesh that has none (``tp``
    alone, say), derived from ``mesh`` itself: FSDP then only applies its
    mixed-precision and offload policies, and a TP DTensor parameter's mesh
    and this one share a root, as FSDP2 requires of 2-D parameters. Every
    rank derives it alike, as it must: deriving a mesh may set up its
    groups collectively."""
    names = mesh.mesh_dim_names or ("dp",)
    return unflatten_mesh(mesh, 0, (1, mesh.shape[0]), ("dp_shard", names[0]))["dp_shard"]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The ``tp`` submesh, or None when there is none (or it has one rank)."""
    names = _names(mesh, KNOWN_DIMS, "device_mesh")
    if "tp" not in names or mesh.shape[names.index("tp")] == 1:
        return None
    return mesh if names == ("tp",) else mesh["tp"]


def moe_dp_dims(moe_mesh: DeviceMesh, device_mesh: DeviceMesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``moe_mesh``'s dim names and its data-parallel ones, checked against
    ``device_mesh``: both must span the same ranks (a MoE mesh is another
    view of the same world, not a subset of it)."""
    names = _names(moe_mesh, MOE_KNOWN_DIMS, "moe_mesh")
    if moe_mesh.size() != device_mesh.size():
        raise ValueError(
            f"moe_mesh spans {moe_mesh.size()} ranks ({dict(zip(names, moe_mesh.shape))}) but device_mesh "
            f"spans {device_mesh.size()}; build both over the same world"
        )
    dims = tuple(n for n in names if n in MOE_DP_DIMS)
    if not dims:
        raise ValueError(
            f"moe_mesh {dict(zip(names, moe_mesh.shape))} has no data-parallel dim "
            f"(one of {', '.join(MOE_DP_DIMS)}) to shard experts over"
        )
    return names, dims


def moe_fsdp_mesh(moe_mesh: DeviceMesh, device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh expert units shard over: ``moe_mesh``'s data-parallel dims,
    ``ep`` left out (experts are already split across it).

    Like :func:`fsdp_mesh` for the dense model, a replicate dim
    (``dp_replicate`` or ``ep_replicate``) is kept as dim 0, so experts get
    HSDP too: sharded within a replica group, replicated across groups.
    Several shard dims (or several replicate dims) are flattened into one.
    A mesh whose only data-parallel dims replicate gets a shard dim of size
    1 (every rank holds its experts whole, DDP style)."""
    names, dims = moe_dp_dims(moe_mesh, device_mesh)
    replicate = tuple(n for n in dims if n in _MOE_REPLICATE_DIMS)
    shard = tuple(n for n in dims if n not in _MOE_REPLICATE_DIMS)
    if not replicate:
        sub = moe_mesh if shard == names else moe_mesh[shard if len(shard) > 1 else shard[0]]
        return sub if len(shard) == 1 else flatten_mesh(sub, _MOE_FLAT_SHARD)
    rep = replicate[0] if len(replicate) == 1 else _MOE_FLAT_REPLICATE
    if not shard:
        sub = moe_mesh[replicate[0]] if len(replicate) == 1 else flatten_mesh(moe_mesh[replicate], rep)
        return unflatten_mesh(sub, 0, (sub.size(), 1), (rep, _REPLICATE_ONLY_SHARD))
    sub = moe_mesh[replicate + shard]
    if len(replicate) == 1 and len(shard) == 1:
        return sub
    # Several dims on a side: flatten all and split into (replicate, shard)
    # again, rather than slicing flattened dims from the root (deprecated).
    sizes = dict(zip(names, moe_mesh.shape))
    shape = (math.prod(sizes[n] for n in replicate), math.prod(sizes[n] for n in shard))
    shd = shard[0] if len(shard) == 1 else _MOE_FLAT_SHARD
    return unflatten_mesh(flatten_mesh(sub, "moe_dp"), 0, shape, (rep, shd))


def ep_size(moe_mesh: DeviceMesh | None) -> int:
    """The size of ``moe_mesh``'s ``ep`` dim; 1 without a MoE mesh or an
    ``ep`` dim (experts are then not split by expert)."""
    if moe_mesh is None or EP_DIM not in (moe_mesh.mesh_dim_names or ()):
        return 1
    return int(moe_mesh.shape[list(moe_mesh.mesh_dim_names or ()).index(EP_DIM)])


def ep_mesh(moe_mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D ``ep`` submesh experts are split across; ``ValueError`` when
    ``moe_mesh`` has no ``ep`` dim."""
    names = tuple(moe_mesh.mesh_dim_names or ())
    if EP_DIM not in names:
        raise ValueError(f"moe_mesh {dict(zip(names, moe_mesh.shape))} has no {EP_DIM!r} dim to split experts across")
    return moe_mesh if names == (EP_DIM,) else moe_mesh[EP_DIM]


def moe_gradient_divide_factor(moe_mesh: DeviceMesh) -> int:
    """What expert gradients are divided by after FSDP sums them: the ranks
    of ``moe_mesh``'s ``ep`` and data-parallel dims together.

    Every one of those ranks sends its tokens into the experts (through the
    model's all-to-all along ``ep``, then FSDP's reduction along the rest),
    so an expert's summed gradient holds one contribution per rank, as a
    dense parameter's does across the dense data-parallel ranks; dividing
    by their number gives the same mean. FSDP alone would divide by the
    data-parallel dims only, ``ep`` times too little under expert
    parallelism. TP ranks folded into these dims count too: they feed the
    experts the same tokens (the experts run on the whole sequence)."""
    names = tuple(moe_mesh.mesh_dim_names or ())
    return math.prod(s for n, s in zip(names, moe_mesh.shape) if n in MOE_DP_DIMS or n == EP_DIM)
