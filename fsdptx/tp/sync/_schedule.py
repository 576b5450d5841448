"""How a call's tensors travel: chunks of at most ``max_bytes`` grouped
by device and communication dtype, views of one reusable buffer per
device, and the pack / collective / unpack loop over them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
import torch
from ...core._chunks import gradient_chunks
from ...core._torch_internals import foreach_copy_, tensor_base

__all__ = []


@dataclass
class _Chunk:
    """One collective: ``slots`` say which tensor (or slice of one, for a
    tensor cut across chunks) fills which span of the buffer."""

    slots: list[int | tuple[int, int, int]]  # tensor index, or (index, start, stop) of its flat view
    spans: list[tuple[int, int, torch.Size | None]]  # per slot: buffer offset, numel, shape (None: flat)
    numel: int
    mean_numel: int  # the first ``mean_numel`` elements hold mean-reduced values
    views: list[torch.Tensor] = field(default_factory=list)  # per slot, once the buffer exists
    whole: list[int] | None = None  # the tensor indices when no slot is a slice (the common case)
    data: torch.Tensor | None = None
    mean: torch.Tensor | None = None


@dataclass
class _Group:
    device: torch.device
    dtype: torch.dtype
    has_mean: bool
    chunks: list[_Chunk]
    divisor: torch.Tensor | None = None  # one buffer element past every chunk's data (see _mean_factor)


@dataclass
class _Schedule:
    """How the tensors of one call travel: per (device, communication dtype)
    group, the chunks and their views of one buffer per device.

    The buffer is made (:meth:`materialize`) by the first call with this
    schedule, around its agreement (see :func:`_overlapped_agreement`), and kept
    with the schedule once a call succeeded, so repeated calls with the same
    layout reuse it (and pack their first chunk while the agreement is in
    flight): no allocation, no page faults, no per-tensor views. Its size is
    the largest chunk plus, for a group with means, one element for the
    divisor, within ``max_bytes``: all the extra memory the call needs, held
    until the layout changes or the model is released.
    """

    key: bytes
    groups: list[_Group]
    materialized: bool = False
    synced: list[int] = field(default_factory=list)  # sync: entries with a gradient to reduce
    call_digest: int = 0  # the agreement's per-call digest, a function of ``key``
    storages: dict[torch.device, torch.Tensor] = field(default_factory=dict)  # the buffer, per device

    def buffer_bytes(self, device: torch.device) -> int:
        """The size of this schedule's buffer on ``device`` (0: none there)."""
        return max(
            ((max(c.numel for c in g.chunks) + g.has_mean) * g.dtype.itemsize for g in self.groups
             if g.device == device),
            default=0,
        )

    def agreement_slot(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer on ``device`` (the caller checks
        it has them) as the agreement's int64 values; only before anything
        is packed."""
        return self.storages[device][:nbytes].view(torch.int64)

    def materialize(self) -> None:
        if self.materialized:
            return
        devices = dict.fromkeys(g.device for g in self.groups)
        storages = {d: torch.empty(self.buffer_bytes(d), dtype=torch.uint8, device=d) for d in devices}
        self.storages = storages
        for g in self.groups:
            storage = storages[g.device]
            typed = storage[: storage.numel() // g.dtype.itemsize * g.dtype.itemsize].view(g.dtype)
            capacity = max(c.numel for c in g.chunks)
            g.divisor = typed[capacity : capacity + 1] if g.has_mean else None
            for c in g.chunks:
                c.views = [
                    typed[o : o + n] if shape is None else typed[o : o + n].view(shape) for o, n, shape in c.spans
                ]
                c.data = typed[: c.numel]
                c.mean = typed[: c.mean_numel] if c.mean_numel else None
        self.materialized = True


def _schedule(
    key: bytes,
    shapes: list[torch.Size],
    dtypes: list[torch.dtype],
    devices: list[torch.device],
    means: list[bool],
    comm_dtype: Callable[[torch.dtype], torch.dtype],
    max_bytes: int,
    where: str,
    names: list[str],
) -> _Schedule:
    """Lay the tensors out in chunks of at most ``max_bytes`` (no memory yet).

    Per (device, communication dtype), mean-reduced tensors come first and
    sum-reduced ones after, each in the given (rank-stable) order, so every
    chunk's means form one prefix and the division is one op per chunk
    rather than one per tensor. Chunks are :func:`gradient_chunks` of
    shape-only ("meta") stand-ins, so the layout is exactly what that
    function promises. A group with means budgets one element of
    ``max_bytes`` for the divisor. Raises ``ValueError`` (before any
    collective) when ``max_bytes`` cannot hold one element plus the divisor.
    """
    order: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for want_mean in (True, False):
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            if means[i] == want_mean and shape.numel():  # empty tensors have nothing to communicate
                order.setdefault((devices[i], comm_dtype(dtype)), []).append(i)
    groups: list[_Group] = []
    for (device, dtype), members in order.items():
        has_mean = means[members[0]]
        reserve = dtype.itemsize if has_mean else 0
        if max_bytes < dtype.itemsize + reserve:
            offenders = [names[i] for i in members][:5]
            raise ValueError(
                f"{where}: max_bytes={max_bytes} cannot hold one {dtype} element"
                + (" plus the mean's divisor" if reserve else "")
                + f" (needs {dtype.itemsize + reserve} bytes) for {offenders}; raise max_bytes. "
                "Nothing was communicated or modified."
            )
        stand_ins = [torch.empty(shapes[i], dtype=dtypes[i], device="meta") for i in members]
        index_of = {id(t): i for t, i in zip(stand_ins, members)}
        chunks: list[_Chunk] = []
        for pieces in gradient_chunks(stand_ins, max_bytes - reserve):
            slots: list[int | tuple[int, int, int]] = []
            spans: list[tuple[int, int, torch.Size | None]] = []
            offset = mean_numel = 0
            for piece in pieces:
                whole = id(piece) in index_of
                i = index_of[id(piece) if whole else id(tensor_base(piece))]
                n = piece.numel()
                if whole:
                    slots.append(i)
                    spans.append((offset, n, shapes[i]))
                else:
                    start = int(piece.storage_offset())
                    slots.append((i, start, start + n))
                    spans.append((offset, n, None))
                offset += n
                if means[i]:
                    mean_numel = offset
            whole_slots = slots if all(isinstance(slot, int) for slot in slots) else None
            chunks.append(_Chunk(slots, spans, offset, mean_numel, whole=whole_slots))  # type: ignore[arg-type]
        groups.append(_Group(device, dtype, has_mean, chunks))
    return _Schedule(key, groups)


def _execute(
    schedule: _Schedule,
    tensors: list[torch.Tensor],
    collective: Callable[[torch.Tensor], None],
    divisor: float,
    agree: Callable[[], Callable[[], None]],
) -> None:
    """Run ``schedule`` on ``tensors`` in place: per chunk, one foreach copy in
    (casting low precision up), one collective, one op turning the mean
    prefix's sums into means (see :func:`_mean_factor`), one foreach copy
    out (casting back).

    ``agree()`` starts the agreement and returns what waits for its result
    (raising on disagreement); see :func:`_overlapped_agreement`. The first
    chunk is packed in between: packing writes only the schedule's own buffer,
    so the agreement's latency overlaps the copy in, and a disagreement
    still raises before any collective on the data and before any tensor
    is written.

    A slice of a non-contiguous tensor (rare for gradients) goes through a
    contiguous copy of that tensor, made once and written back at the end:
    the one allocation outside ``max_bytes``.
    """
    factor, multiply = _mean_factor(divisor)
    finish: Callable[[], None] | None = agree()
    try:
        staged: dict[int, torch.Tensor] = {}
        for group in schedule.groups:
            if group.divisor is not None:
                group.divisor.fill_(factor)  # another dtype's group may have overwritten it
            for chunk in group.chunks:
                if chunk.whole is not None:
                    sources = [tensors[i] for i in chunk.whole]
                else:
                    sources = []
                    for slot in chunk.slots:
                        if isinstance(slot, int):
                            sources.append(tensors[slot])
                            continue
                        i, start, stop = slot
                        t = tensors[i]
                        if not t.is_contiguous():
                            found = staged.get(i)
                            if found is None:  # copied once, not once per chunk it spans
                                found = staged[i] = t.contiguous()
                            t = found
                        sources.append(t.view(-1)[start:stop])
                foreach_copy_(chunk.views, sources)
                if finish is not None:
                    done, finish = finish, None
                    done()
                collective(chunk.data)  # type: ignore[arg-type]
                if chunk.mean is not None:
                    if multiply:
                        chunk.mean.mul_(group.divisor)  # type: ignore[arg-type]
                    else:
                        chunk.mean.div_(group.divisor)  # type: ignore[arg-type]
                foreach_copy_(sources, chunk.views)
        for i, work in staged.items():
            tensors[i].copy_(work)
    finally:
        if finish is not None:  # nothing to pack, or packing raised: still complete the agreement
            finish()


def _mean_factor(divisor: float) -> tuple[float, bool]:
    """What the buffer's divisor slot holds and whether the mean prefix is
    multiplied by it (else divided).

    For a group size that is a power of two (every TP size in practice) the
    reciprocal is exact, and multiplying by it gives the correctly rounded
    quotient, bit for bit what dividing gives, at half the cost of a
    division on CPU. Other sizes divide. The factor travels in the buffer,
    not as a Python scalar, because a scalar operand becomes a tensor the
    allocator makes on every call, outside ``max_bytes``.
    """
    if math.frexp(divisor)[0] == 0.5:
        return 1.0 / divisor, True
    return divisor, False
