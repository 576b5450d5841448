"""Who the TP peers are and what they hold alike: the replication test
(:func:`is_tp_replicated`), the TP group of a mesh as one call sees it
(:class:`_TPContext`), and the arguments every operation checks before its
first collective."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["ModelParts", "is_tp_replicated"]


ModelParts = Sequence[nn.Module] | nn.Module


def is_tp_replicated(
    tensor: torch.Tensor,
    tp_group_ranks: Sequence[int],
    current_rank: int,
    tp_axis_name: str,
) -> bool:
    """Whether ``tensor``'s rank-local storage is a copy of every TP peer's.

    A plain tensor is a full replica. A DTensor is one when every TP peer that
    appears in its mesh differs from this rank only along mesh dims where the
    DTensor is ``Replicate``. Comparing coordinates, not axis names, covers
    both awkward cases: a DTensor on a DP-only submesh holds no TP peer and is
    a replica on each TP rank; an MoE mesh that folds the TP ranks into
    ``ep``/``ep_shard`` shards along those dims, so the copies differ.
    ``tp_axis_name`` is accepted for the seed's signature; the coordinates
    already say everything it would.

    Args:
        tensor: a plain tensor or a DTensor.
        tp_group_ranks: the global ranks of this rank's TP group.
        current_rank: this rank's global rank.
        tp_axis_name: the TP mesh dim name (kept for the seed's signature).

    Returns:
        Whether this rank's local storage is a copy of every TP peer's.

    Raises:
        TypeError: an argument of the wrong type (named).

    Example::

        tp_ranks = mesh["tp"].mesh.flatten().tolist()
        replicated = [n for n, p in model.named_parameters() if fsdptx.is_tp_replicated(p, tp_ranks, rank, "tp")]
    """
    where = "is_tp_replicated"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: tensor must be a torch.Tensor (or DTensor), got {type(tensor).__name__}")
    if isinstance(tp_group_ranks, (str, bytes)) or not isinstance(tp_group_ranks, Sequence) or not all(
        type(r) is int for r in tp_group_ranks
    ):
        raise TypeError(f"{where}: tp_group_ranks must be a sequence of int ranks, got {tp_group_ranks!r}")
    if type(current_rank) is not int:
        raise TypeError(f"{where}: current_rank must be an int, got {type(current_rank).__name__} {current_rank!r}")
    if not isinstance(tp_axis_name, str):
        raise TypeError(f"{where}: tp_axis_name must be a str, got {type(tp_axis_name).__name__}")
    if not isinstance(tensor, DTensor):
        return True
    return _replicated_on_mesh(tensor.device_mesh, tuple(tensor.placements), tuple(tp_group_ranks), current_rank)


def _replicated_on_mesh(
    mesh: DeviceMesh, placements: tuple[object, ...], tp_group_ranks: tuple[int, ...], current_rank: int
) -> bool:
    ranks = mesh.mesh
    mine = (ranks == current_rank).nonzero()
    if mine.numel() == 0:
        return True  # this rank holds no shard of it at all: nothing to compare
    me = mine[0].tolist()
    for peer in tp_group_ranks:
        if peer == current_rank:
            continue
        found = (ranks == peer).nonzero()
        if found.numel() == 0:
            continue  # the peer is not in this tensor's mesh: it keeps its own copy
        for dim, (a, b) in enumerate(zip(me, found[0].tolist())):
            if a != b and not placements[dim].is_replicate():  # type: ignore[attr-defined]
                return False
    return True


def _check_arguments(
    where: str, model_parts: object, device_mesh: object, tp_axis_name: object, max_bytes: object
) -> tuple[list[nn.Module], int]:
    """Validate every argument locally; return the model parts as a list and
    ``max_bytes`` as an int.

    Checking before the first collective means a bad argument never leaves
    half the gradients reduced (a retry would then double-count ``sum``s).
    A rank that raises here has entered no collective; if only some ranks
    passed the bad argument, their peers wait in the agreement collective
    until the process group's timeout expires (see the public docstrings).
    """
    if type(max_bytes) is int and max_bytes > 0 and type(tp_axis_name) is str:  # the common case, cheaply
        if isinstance(model_parts, nn.Module):
            parts = [model_parts]
        elif type(model_parts) is list and model_parts and all(isinstance(m, nn.Module) for m in model_parts):
            parts = list(model_parts)
        else:
            parts = None
        if parts is not None and (device_mesh is None or isinstance(device_mesh, DeviceMesh)):
            return parts, max_bytes
    if isinstance(model_parts, nn.Module):
        parts = [model_parts]
    elif isinstance(model_parts, Sequence) and all(isinstance(m, nn.Module) for m in model_parts):
        parts = list(model_parts)
    else:
        raise TypeError(f"{where}: model_parts must be an nn.Module or a sequence of them, got {model_parts!r}")
    if not parts:
        raise ValueError(f"{where}: model_parts is empty; pass the model, or every pipeline stage this rank holds")
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"{where}: device_mesh must be a DeviceMesh or None, got {type(device_mesh).__name__}")
    if not isinstance(tp_axis_name, str):
        raise TypeError(f"{where}: tp_axis_name must be a str, got {tp_axis_name!r}")
    if isinstance(max_bytes, bool) or not hasattr(type(max_bytes), "__index__"):
        raise TypeError(f"{where}: max_bytes must be an integer number of bytes, got {max_bytes!r}")
    size = operator.index(max_bytes)  # type: ignore[arg-type]
    if size <= 0:
        raise ValueError(f"{where}: max_bytes must be positive, got {size}")
    return parts, size


@dataclass(frozen=True)
class _TPContext:
    group: dist.ProcessGroup
    group_name: str  # what caches key on: never the object (see _RememberedContext)
    ranks: tuple[int, ...]
    rank: int
    device: torch.device

    def replicated(self) -> Callable[[torch.Tensor], bool]:
        """``is_tp_replicated`` memoised per (mesh, placements)."""
        cache: dict[tuple[int, tuple[object, ...]], bool] = {}

        def check(t: torch.Tensor) -> bool:
            if not isinstance(t, DTensor):
                return True
            key = (id(t.device_mesh), tuple(t.placements))
            if key not in cache:
                cache[key] = _replicated_on_mesh(t.device_mesh, key[1], self.ranks, self.rank)
            return cache[key]

        return check

    def dtensor_keeps(self, axis: str) -> Callable[[torch.Tensor], bool]:
        """Whether a tensor is a DTensor on a mesh with an ``axis`` dim (the
        TP dim) that holds this rank and a TP peer of it, memoised per mesh:
        then DTensor itself keeps its TP replicas alike (``Replicate`` on
        that dim is its promise that the peers' local tensors are equal; a
        gradient it leaves ``Partial`` is no replica). A plain tensor, a
        DTensor on a mesh without TP peers (FSDP's data-parallel submesh),
        or one whose mesh holds them under another dim (a mesh an FSDP unit
        replicates across them) is not."""
        cache: dict[int, bool] = {}
        peers = [r for r in self.ranks if r != self.rank]

        def check(t: torch.Tensor) -> bool:
            if not isinstance(t, DTensor):
                return False
            mesh = t.device_mesh
            found = cache.get(id(mesh))
            if found is None:
                ranks = mesh.mesh
                found = cache[id(mesh)] = (
                    axis in (mesh.mesh_dim_names or ())
                    and bool((ranks == self.rank).any())
                    and any(bool((ranks == r).any()) for r in peers)
                )
            return found

        return check


_CPU = torch.device("cpu")


def _device(device_type: str) -> torch.device:
    """The device collectives of a mesh of ``device_type`` use on this rank
    now (for an accelerator, the current one)."""
    if device_type == "cpu":
        return _CPU
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


@dataclass(frozen=True)
class _RememberedContext:
    """A TP context kept on the model's cache for the next call with the
    same mesh and axis: deriving it goes through half a dozen
    ``torch.distributed`` lookups, tens of microseconds once a backward pass
    has evicted them from the CPU caches.

    Mesh and process group are held by weak reference: a strong one on the
    model would keep a destroyed process group alive until interpreter exit,
    where tearing down its threads aborts the process. A mesh's groups are
    fixed when it is made, and a rank's place in a group for the group's
    life, so while both references are alive the context is still right;
    the device is read anew each call (an accelerator's current device may
    change).
    """

    mesh: weakref.ref[DeviceMesh]
    axis: str
    group: weakref.ref[dist.ProcessGroup]
    group_name: str
    ranks: tuple[int, ...]
    rank: int
    device_type: str

    def recall(self, device_mesh: DeviceMesh | None, tp_axis_name: str) -> _TPContext | None:
        """The context for this mesh and axis, or ``None`` when it is another
        one or either reference died."""
        mesh = self.mesh()
        if mesh is None or mesh is not device_mesh or self.axis != tp_axis_name:
            return None  # a dead mesh is None, which must not match device_mesh=None
        group = self.group()
        if group is None:
            return None
        return _TPContext(group, self.group_name, self.ranks, self.rank, _device(self.device_type))
