"""Replica audit: check, with real collectives, that copies meant to be
identical are identical.

TP peers hold copies of every TP-replicated parameter (what
:func:`fsdptx.synchronize_tp_replica_gradients` keeps in step); HSDP's
``dp_replicate`` peers hold copies of the same shards; a plain parameter is a
copy on every data-parallel rank. A forgotten sync, a rank-dependent
initialization or a bad checkpoint load lets them drift apart silently: the
loss still goes down. The audit finds that in CI, or every N steps in a job
(:mod:`fsdptx.tp._audit_every`).

It is cheap when all is well: per group, one checksum per tensor (a
position-weighted sum of the rank-local storage's bits), digested with the
group's layout into three int64 values and reduced once with MAX over them
and their negations, so every peer learns the largest and smallest of each.
Only where the digests differ does the flat buffer of the checksums
themselves travel, and only tensors whose checksums differ ("suspects") are
compared element by element, the same way. Which tensors each group compares is derived once and cached on
the model like the TP-replica sync's layout (off inside
``fsdptx.caches(enabled=False)``), so a repeated audit does not walk the
model.

Collective discipline is the sync's: arguments are checked before the
first collective; the peers of each group agree first (MAX of counts and
layout digests, which works on a fake process group, where a collective
returns the local input) on what shapes the collectives, and a disagreement
anywhere in the mesh raises on every rank instead of leaving some waiting.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core._caches import process_memo
from ..core._meshes import KNOWN_DIMS
from .sync._context import _device, _TPContext
from .sync._layout import _digest_bytes, _Layout, _layout

__all__ = ["DP_DIMS", "Drift", "ReplicaAudit", "audit_replicas", "check_arguments", "format_drift"]

ModelParts = Sequence[nn.Module] | nn.Module
# Mesh dims whose peers hold data-parallel copies: a tensor replicated along
# one of them (a plain tensor, HSDP's Replicate dim) must be equal there.
DP_DIMS = tuple(n for n in KNOWN_DIMS if n not in ("tp", "pp"))


@dataclass(frozen=True)
class Drift:
    """One tensor whose copies differ across one group of peers.

    ``fqn`` names it (the smallest name of a tied tensor), ``mesh_dim`` the
    mesh dim the group spans, ``ranks`` the group's global ranks, and
    ``max_abs_diff`` the largest difference between any two copies of one
    element (``inf`` where one copy is NaN or infinite and another is not).

    Attributes:
        fqn: the tensor's name.
        mesh_dim: the mesh dim name the group spans.
        ranks: the group's global ranks.
        max_abs_diff: the largest difference between two copies of one
            element.

    Example::

        for d in fsdptx.audit_replicas([model], mesh).drifted:
            print(f"{d.fqn} differs along {d.mesh_dim} on ranks {d.ranks}: {d.max_abs_diff:.3g}")
    """

    fqn: str
    mesh_dim: str
    ranks: tuple[int, ...]
    max_abs_diff: float


@dataclass(frozen=True)
class ReplicaAudit:
    """The audit's result; ``drifted`` is the same on every rank of the mesh.

    ``drifted`` lists every tensor whose copies differ beyond the tolerance
    in any group of the mesh, in rank-stable order (mesh dim order, then
    FQN, then ranks); ``checked`` maps each audited mesh dim to the number
    of tensors compared on this rank along it.

    Attributes:
        drifted: the tensors whose copies differ, as :class:`Drift` entries.
        checked: mesh dim -> tensors compared along it on this rank.

    Example::

        audit = fsdptx.audit_replicas([model], mesh, atol=1e-6)
        assert audit.ok, audit.drifted
    """

    drifted: tuple[Drift, ...]
    checked: tuple[tuple[str, int], ...]

    @property
    def ok(self) -> bool:
        """No copies differ beyond the tolerance."""
        return not self.drifted

    def __str__(self) -> str:
        if self.ok:
            dims = ", ".join(f"{n} along {d}" for d, n in self.checked) or "nothing to compare"
            return f"replicas in sync ({dims})"
        return format_drift(self.drifted)


def format_drift(drifted: Sequence[Drift]) -> str:
    """A fixed-width table of drifted tensors: fqn, dim, ranks, max abs diff."""
    rows = [("fqn", "dim", "ranks", "max abs diff")]
    rows += [(d.fqn, d.mesh_dim, ",".join(map(str, d.ranks)), f"{d.max_abs_diff:.6g}") for d in drifted]
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return f"{len(drifted)} tensor copies differ across replicas:\n" + "\n".join(lines)


# ----------------------------------------------------------------------------
# Arguments.


def _tolerance(value: object, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {name} must be a non-negative number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {name} must be finite and >= 0, got {value!r}")
    return float(value)


def check_arguments(
    model_parts: object,
    device_mesh: object,
    atol: object,
    rtol: object,
    buffers: object,
    tp_axis_name: object,
    where: str = "audit_replicas",
) -> tuple[list[nn.Module], DeviceMesh, float, float]:
    """Every argument, checked locally before any collective."""
    if isinstance(model_parts, nn.Module):
        parts = [model_parts]
    elif isinstance(model_parts, Sequence) and not isinstance(model_parts, str) and all(
        isinstance(m, nn.Module) for m in model_parts
    ):
        parts = list(model_parts)
    else:
        raise TypeError(f"{where}: model_parts must be an nn.Module or a sequence of them, got {model_parts!r}")
    if not parts:
        raise ValueError(f"{where}: model_parts is empty; pass the model, or every pipeline stage this rank holds")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"{where}: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    if not device_mesh.mesh_dim_names:
        raise ValueError(
            f"{where}: device_mesh has no dim names, so which dims hold replicas is unknown; build it with "
            f"init_device_mesh(..., mesh_dim_names=...) naming dims among {', '.join(KNOWN_DIMS)}"
        )
    if not isinstance(tp_axis_name, str):
        raise TypeError(f"{where}: tp_axis_name must be a str, got {tp_axis_name!r}")
    if not isinstance(buffers, bool):
        raise TypeError(f"{where}: buffers must be a bool, got {buffers!r}")
    return parts, device_mesh, _tolerance(atol, "atol", where), _tolerance(rtol, "rtol", where)


# ----------------------------------------------------------------------------
# What each group compares.


@dataclass(frozen=True)
class _Group:
    dim: str
    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    layout: _Layout  # which tensors, in which order, and their digest
    tensors: list[torch.Tensor]  # rank-local storage, one per layout entry

    @property
    def fqns(self) -> list[str]:
        return [e.fqn for e in self.layout.entries]


def _groups(
    parts: list[nn.Module], mesh: DeviceMesh, buffers: bool, tp_axis_name: str, device: torch.device
) -> list[_Group]:
    """One group per audited mesh dim of size > 1 (in mesh order): the TP
    dim compares exactly what the TP-replica sync keeps in step (its walk,
    exclusions and replication test), a data-parallel dim every tensor
    whose placements replicate it along that dim, excluded subtrees too.

    Each group's tensors come from the sync's layout machinery, so they are
    cached on the model like the sync's and re-derived only when the model,
    its marks or the mesh changed (:func:`fsdptx.tp.sync._layout._layout`)."""
    names = mesh.mesh_dim_names or ()
    rank = dist.get_rank()
    groups: list[_Group] = []
    for name, size in zip(names, mesh.shape):
        if size == 1 or (name != tp_axis_name and name not in DP_DIMS):
            continue
        group = mesh.get_group(name)
        ranks = tuple(dist.get_process_group_ranks(group))
        # The sync's replication test, with this dim's peers in the TP role.
        ctx = _TPContext(group, group.group_name, ranks, rank, device)
        # One cached layout per dim and per choice of buffers, so audits
        # with and without buffers each keep theirs.
        op = f"audit {name}{' with buffers' if buffers else ''}"
        layout = _layout(parts, ctx, 0, op, with_buffers=buffers, honour_exclusions=name == tp_axis_name)
        local = layout.placed_locals(layout.tensors)
        assert local is not None, "a valid layout's DTensors keep their placements"
        groups.append(_Group(name, group, ranks, layout, local))
    return groups


# ----------------------------------------------------------------------------
# Collectives. Every one is a MAX all-reduce over a group: on a fake process
# group it returns the local input, so the peers always "agree" there.


def _max_and_min(values: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise largest and smallest of ``values`` over the group, from
    one MAX all-reduce of the values and their negations."""
    both = torch.cat([values, -values])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = values.numel()
    return both[:n], -both[n:]


def _mesh_max(flags: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The elementwise maximum over the whole mesh: one MAX all-reduce
    along each dim in turn (the mesh's own groups; no new group)."""
    for name, size in zip(mesh.mesh_dim_names or (), mesh.shape):
        if size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mesh.get_group(name))
    return flags


def _mesh_gather(records: list[Drift], mesh: DeviceMesh) -> list[Drift]:
    """Every rank's records, on every rank: an all-gather along each dim
    in turn, so after the last one each rank holds the whole mesh's."""
    merged = set(records)
    for name, size in zip(mesh.mesh_dim_names or (), mesh.shape):
        if size > 1:
            found: list[Any] = [None] * size
            dist.all_gather_object(found, sorted(merged, key=_order_key), group=mesh.get_group(name))
            merged = {d for part in found for d in part}
    return sorted(merged, key=_order_key)


def _order_key(d: Drift) -> tuple[str, tuple[int, ...]]:
    return (d.fqn, d.ranks)


def _disagreement(g: _Group) -> str:
    """Names what the peers of ``g`` disagree on (one all-gather of
    descriptions within the group, which all its members run)."""
    mine = dict(zip(g.fqns, g.layout.descriptions))
    found: list[Any] = [None] * len(g.ranks)
    dist.all_gather_object(found, mine, group=g.group)
    lines = []
    for fqn in sorted({f for d in found for f in d}):
        seen = [d.get(fqn, "absent") for d in found]
        if len(set(seen)) > 1:
            lines.append(f"{fqn}: " + ", ".join(f"rank {r}: {s}" for r, s in zip(g.ranks, seen)))
    return "\n  ".join(lines[:20] + ([f"... and {len(lines) - 20} more"] if len(lines) > 20 else []))


# Checksums are taken per row of at most _ROW_WORDS 32-bit words: a row's
# weighted sum (weights in [1, 2), words below 2**31 in magnitude) stays
# below 2**46, where fp64 summation over 2**14 terms rounds by less than a
# quarter, while changing any one word by at least 1 moves the exact sum by
# at least 1. So two copies that differ in one word always get different
# checksums. Rows are converted to fp64 _BATCH_WORDS words at a time (8 MiB).
_ROW_WORDS = 2**14
_BATCH_WORDS = 2**20
_GOLDEN = (5**0.5 - 1) / 2


def _weights(words: int, device: torch.device) -> torch.Tensor:
    """Fixed weights in [1, 2), the same on every rank: the fractional parts
    of multiples of the golden ratio, so no two positions of a row weigh
    alike (swapped words change the sum)."""
    return torch.arange(1, words + 1, dtype=torch.float64, device=device).mul_(_GOLDEN).frac_().add_(1.0)


@process_memo(limit=2)
def _row_weights(device: torch.device) -> torch.Tensor:
    """:func:`_weights` of one row, kept for the next audit (128 KiB per
    device, cleared by :func:`fsdptx.clear_caches`)."""
    return _weights(_ROW_WORDS, device)


def _whole_words(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes fill whole 32-bit words, so they can be read as
    int32 without a copy (not 1-byte elements, nor an odd number of 2-byte
    ones)."""
    return t.element_size() > 1 and t.numel() * t.element_size() % 4 == 0


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat int32 tensor; each element widened to a word
    where they do not fill whole words (a copy)."""
    flat = t.reshape(-1)
    if _whole_words(flat):
        return flat.view(torch.int32)
    narrow = {1: torch.uint8, 2: torch.int16}[flat.element_size()]
    return flat.view(narrow).to(torch.int32)


def _row_sums(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row's weighted sum in fp64, ``_BATCH_WORDS`` words at a time."""
    per_batch = max(1, _BATCH_WORDS // max(1, rows.shape[1]))
    w = weights[: rows.shape[1]]
    return torch.cat([part.to(torch.float64).mul_(w).sum(1) for part in rows.split(per_batch)])


def _checksums(tensors: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Checksums of the tensors' bits, and how many rows each tensor has.

    Each tensor is read as 32-bit words (its bits, not its values), in rows
    of at most :data:`_ROW_WORDS` words; a row's checksum is its
    position-weighted sum in fp64, exact enough that a row differing in one
    word always gets another checksum. Bits make equal copies agree
    whatever they hold (an infinity, a NaN), and a change of sign, a swap
    or a compensating pair shows; copies that differ only in bits (``-0.0``
    and ``0.0``, two NaN payloads) are suspects the elementwise comparison
    then finds equal. Tensors of one dtype, device and shape are stacked
    and summed together: a few kernels per batch instead of a few per
    tensor, which is what a call over many small tensors costs."""
    counts = [max(1, -(-_words_count(t) // _ROW_WORDS)) for t in tensors]
    out = torch.zeros(sum(counts), dtype=torch.float64, device=device)
    if not tensors:
        return out, counts
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    alike: dict[tuple[torch.dtype, torch.device, torch.Size], list[int]] = {}
    for i, t in enumerate(tensors):
        alike.setdefault((t.dtype, t.device, t.shape), []).append(i)
    with torch.no_grad():
        for (_dtype, where, _shape), indices in alike.items():
            w = _row_weights(where)
            first = tensors[indices[0]]
            n = _words_count(first)
            if n == 0:
                continue
            if _whole_words(first) and n <= _ROW_WORDS:  # one row each: stack them
                stacked = torch.stack([tensors[i] for i in indices]).reshape(len(indices), -1).view(torch.int32)
                out[[starts[i] for i in indices]] = _row_sums(stacked, w).to(device)
                continue
            for i in indices:
                words = _words(tensors[i])
                rows = torch.nn.functional.pad(words, (0, -words.numel() % _ROW_WORDS)).view(-1, _ROW_WORDS) \
                    if words.numel() > _ROW_WORDS else words.view(1, -1)
                out[starts[i] : starts[i] + counts[i]] = _row_sums(rows, w).to(device)
    return out, counts


def _words_count(t: torch.Tensor) -> int:
    """How many int32 words :func:`_words` makes of ``t``."""
    return t.numel() * t.element_size() // 4 if _whole_words(t) else t.numel()


def _checksums_digest(checksums: torch.Tensor) -> int:
    """A 62-bit digest of a group's checksums (order included), so a clean
    audit compares all of them in the agreement's one collective."""
    return _digest_bytes(checksums.cpu().numpy().tobytes())


# Elements of suspects compared per collective: each travels as two fp64
# values (itself and its negation), so a chunk's buffer is at most 64 MiB.
_SUSPECT_CHUNK_NUMEL = 2**22


def _suspect_chunks(sizes: list[int]) -> list[list[int]]:
    """Indices of suspects in chunks of at most :data:`_SUSPECT_CHUNK_NUMEL`
    elements, in order; a larger suspect is a chunk of its own."""
    chunks: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if not chunks or total + n > _SUSPECT_CHUNK_NUMEL:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += n
    return chunks


def _compare_suspects(
    tensors: list[torch.Tensor], g: _Group, atol: float, rtol: float, device: torch.device
) -> list[float | None]:
    """Per suspect, the largest spread of one element over the group, or
    ``None`` when every element is within ``atol + rtol * |value|``. One
    MAX all-reduce per chunk of suspects."""
    out: list[float | None] = []
    for chunk in _suspect_chunks([t.numel() for t in tensors]):
        with torch.no_grad():
            flat = torch.cat([tensors[i].reshape(-1).to(device, torch.float64) for i in chunk])
        high, low = _max_and_min(torch.nan_to_num(flat, nan=math.inf, posinf=math.inf, neginf=-math.inf), g.group)
        spread = torch.where(high == low, torch.zeros_like(high), high - low)  # equal infinities: no spread
        # An infinite spread (a copy is infinite or NaN where another is not)
        # is drift under any tolerance; rtol * inf would make it NaN, never over.
        over = (spread > atol + rtol * torch.maximum(high.abs(), low.abs())) | spread.isinf()
        sizes = [tensors[i].numel() for i in chunk]
        for part, bad in zip(spread.split(sizes), over.split(sizes)):
            out.append(float(part.max()) if bool(bad.any()) else None)
    return out


def audit_replicas(
    model_parts: ModelParts,
    device_mesh: DeviceMesh,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    buffers: bool = False,
    tp_axis_name: str = "tp",
) -> ReplicaAudit:
    """Check that every copy of a replicated tensor is equal across its peers.

    Audited along the TP dim: exactly what
    :func:`fsdptx.synchronize_tp_replica_gradients` keeps in step (TP-
    replicated parameters outside excluded subtrees; with ``buffers`` also
    the replicated buffers :func:`fsdptx.broadcast_tp_replicas` covers).
    Along each data-parallel dim (``dp_replicate``, ``dp_shard``/``dp``,
    ``cp``): every tensor whose placements replicate it there (HSDP's
    replicated shards, plain parameters). Rank-local storage is compared.

    Per group: one MAX all-reduce of the layout (count and digest) and a
    digest of every tensor's checksum (of its bits); only where those
    digests differ, a MAX all-reduce of the checksums themselves, then for
    suspects only an elementwise MAX all-reduce (per chunk of at most 2**22
    elements). Across the mesh, unless one audited dim spans it (then the
    group's results already are the mesh's): a flag per stage and, only
    when something drifted, an all-gather of the findings, so the result is
    the same on every rank. A clean audit of a TP-only mesh is 1
    collective.
    Call it on every rank of the mesh at the same point (e.g. after
    ``optimizer.step()``). No mesh dim to audit (all of size 1, or none
    named ``tp``/data-parallel): a clean audit, no collective.

    Args:
        model_parts: the model, or every pipeline stage this rank holds.
        device_mesh: the mesh the model was parallelized on (dims named).
        atol: absolute tolerance per element (default exact).
        rtol: tolerance relative to the element's largest magnitude.
        buffers: also audit buffers.
        tp_axis_name: the TP dim's name.

    Returns:
        A :class:`ReplicaAudit`; ``.ok`` is true when nothing drifted,
        ``.drifted`` names each drifted tensor, dim, ranks and difference.

    Raises:
        TypeError, ValueError: an invalid argument (named), before any
            collective.
        RuntimeError: peers of some group disagree on the tensors to
            compare (set, order, dtypes, local shapes, placements): raised on
            every rank of the mesh, naming the tensors where it can, with
            nothing compared.

    Example::

        optimizer.step()
        audit = fsdptx.audit_replicas([model], mesh)
        if not audit.ok:
            print(audit)   # fqn, dim, ranks, max abs diff
    """
    parts, mesh, atol, rtol = check_arguments(model_parts, device_mesh, atol, rtol, buffers, tp_axis_name)
    device = _device(mesh.device_type)
    groups = _groups(parts, mesh, buffers, tp_axis_name, device)

    # When the mesh has one dim of size > 1 and it is audited, that group
    # is the whole mesh: what its collectives return is already the same
    # on every rank, and the mesh-wide flag and gather are skipped.
    if not groups:
        return ReplicaAudit((), ())
    spanning = [n for n, size in zip(mesh.mesh_dim_names or (), mesh.shape) if size > 1]
    group_is_mesh = len(groups) == 1 and spanning == [groups[0].dim]

    # 1. One collective per group carries the layout (count and digest) and a
    # digest of every tensor's checksum: peers that agree on all three
    # hold equal copies (the clean audit ends here), peers that disagree
    # on the layout raise, and only a group whose checksums differ goes on.
    sums = [_checksums(g.tensors, device) for g in groups]
    disagree, differ = [], []
    for g, checksums in zip(groups, sums):
        fields = torch.tensor([len(g.tensors), g.layout.digest, _checksums_digest(checksums[0])], dtype=torch.int64)
        high, low = _max_and_min(fields.to(device), g.group)
        disagree.append(int(not torch.equal(high[:2], low[:2])))
        differ.append(bool(high[2] != low[2]))
    flags = torch.tensor(disagree, dtype=torch.int64, device=device)
    if not group_is_mesh:
        flags = _mesh_max(flags, mesh)
    if bool(flags.any()):
        details = [
            f"along {g.dim} among ranks {list(g.ranks)}:\n  {_disagreement(g)}" for g, d in zip(groups, disagree) if d
        ]
        where = [g.dim for g, f in zip(groups, flags.tolist()) if f]
        raise RuntimeError(
            f"audit_replicas: peers disagree on which tensors to compare along {where} (set, order, dtypes, "
            "local shapes or placements); every rank must pass the same model parts, parallelized the same "
            "way. Nothing was compared."
            + ("\n" + "\n".join(details) if details else " See the error on the ranks of those groups.")
        )

    # 2. Where the checksums differ: each tensor's, then suspects elementwise.
    records: list[Drift] = []
    checked = [(g.dim, len(g.tensors)) for g in groups]
    for g, checksums, different in zip(groups, sums, differ):
        if not different:
            continue
        rows, counts = checksums
        high, low = _max_and_min(rows, g.group)
        owners = torch.repeat_interleave(torch.arange(len(counts), device=high.device), torch.tensor(counts, device=high.device))
        suspects = sorted(set(owners[high != low].tolist()))
        if suspects:
            diffs = _compare_suspects([g.tensors[i] for i in suspects], g, atol, rtol, device)
            records += [Drift(g.fqns[i], g.dim, g.ranks, d) for i, d in zip(suspects, diffs) if d is not None]

    # 3. Findings shared across the mesh, so every rank returns the same.
    if not group_is_mesh:
        found = _mesh_max(torch.tensor([int(bool(records))], dtype=torch.int64, device=device), mesh)
        if bool(found.item()):
            records = _mesh_gather(records, mesh)
    order = {n: i for i, n in enumerate(mesh.mesh_dim_names or ())}
    records.sort(key=lambda d: (order[d.mesh_dim], d.fqn, d.ranks))
    return ReplicaAudit(tuple(records), tuple(checked))
