"""The agreement before any TP-replica collective: every peer learns what
every other is about to do (entry count, layout digest, per-call digest,
sparse gradients), in one all-to-all overlapped with packing, and a
disagreement raises on every peer, naming the tensors, with nothing
changed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import torch
import torch.distributed as dist
from ._context import _TPContext
from ._layout import _Layout, _digest
from ._schedule import _Schedule

__all__ = []


_AGREEMENT_FIELDS = 4  # per rank: entry count, layout digest, call digest, any sparse (see _agree)


def _agreement_bytes(group_size: int) -> int:
    """The agreement's int64 values: this rank's fields once per peer (what
    it sends), then every peer's (what it receives)."""
    return 2 * group_size * _AGREEMENT_FIELDS * 8


def _no_wait() -> None:
    return None


def _overlapped_agreement(
    schedule: _Schedule, start: Callable[[torch.Tensor | None], Callable[[], None]], ctx: _TPContext
) -> Callable[[], Callable[[], None]]:
    """What :func:`_execute` calls to agree.

    When the schedule's buffer already exists (a repeated call), that is
    ``start`` with a small tensor of its own, so the first chunk is packed
    while the agreement is in flight. Otherwise the agreement runs to the
    end first, in a call whose peak extra memory must stay within
    ``max_bytes``: the buffer is made first and the agreement's values
    travel in its head, which nothing uses until the agreement is over. A
    separate agreement tensor would not do even if freed before the buffer
    is made: the process group's worker thread may hold the last reference
    to it a little longer. Only a buffer too small for the agreement's
    values (a budget or gradients of a few dozen bytes per TP rank) falls
    back to that: agreement first, buffer after.
    """
    if schedule.materialized:
        return lambda: start(None)
    need = _agreement_bytes(len(ctx.ranks))
    if schedule.buffer_bytes(ctx.device) >= need:
        schedule.materialize()
        start(schedule.agreement_slot(ctx.device, need))()
    else:
        start(None)()
        schedule.materialize()
    return lambda: _no_wait


def _call_digest(states: bytes, deviations: list[str]) -> int:
    """The agreement's digest of one call's gradient states and deviations."""
    return _digest(states.hex() + "\n".join(deviations)) if states or deviations else 0


def _agree(
    where: str,
    ctx: _TPContext,
    layout: _Layout,
    max_bytes: int,
    call_digest: int,
    states: bytes,
    deviations: list[str],
    sparse: list[str],
    slot: torch.Tensor | None,
) -> Callable[[], None]:
    """Start checking, with one small collective, that every TP peer is
    about to run the same collectives on the same things; return what
    finishes the check: it waits and raises the same ``RuntimeError`` on
    every peer if not. Nothing may be written or communicated in between
    but the caller's private buffer.

    Each rank sends its fields (entry count, layout digest, per-call
    digest, any sparse) to every peer in one all-to-all, so every peer holds
    every peer's fields (an all-gather). The layout digest (cached) covers
    every entry's FQN, dtype, rank-local shape, placements and mark and
    ``max_bytes``, hence the chunk layout; the per-call digest covers each
    gradient's presence and any way it departs from its parameter. Every
    peer sees the same rows and so takes the same branch: none can wait in
    a collective another skipped. Only on disagreement does a second
    collective (an all-gather of each rank's description) name the
    offenders. On a fake process group every received row is the local
    one, so peers always agree there and only local checks (sparsity) fire.

    Why an all-to-all: the agreement's latency is most of what a call adds
    to its data's own collectives. Measured on gloo (CPU, two and four
    ranks), an all-to-all of the fields took about half the latency of a
    MAX all-reduce of the fields and their negations (the obvious way to
    get every peer's minimum and maximum), and unlike an all-gather, which
    sits in between, it writes its output in place: gloo's all-gather
    allocates staging tensors that ``max_bytes`` does not cover.

    The values go into ``slot`` when given (see :func:`_overlapped_agreement`)
    by scalar fills and an in-place broadcast copy, which allocate nothing,
    whereas building a tensor from them to copy in would. The received rows
    start zeroed either way, so nothing inspecting the collective's
    arguments sees stale buffer bytes.
    """
    local = [len(layout.entries), layout.digest, call_digest, int(bool(sparse))]
    size = len(ctx.ranks)
    half = size * _AGREEMENT_FIELDS
    if slot is None:
        values = torch.tensor(local * size + [0] * half, dtype=torch.int64, device=ctx.device)
    else:
        values = slot
        for i, v in enumerate(local):
            values[i].fill_(v)
        values[:half].view(size, _AGREEMENT_FIELDS)[1:].copy_(values[:_AGREEMENT_FIELDS])
        values[half:].zero_()
    received = values[half:]
    work = dist.all_to_all_single(received, values[:half], group=ctx.group, async_op=True)

    def finish() -> None:
        work.wait()
        rows = received.view(size, _AGREEMENT_FIELDS).tolist()
        if all(row[:3] == rows[0][:3] for row in rows):
            if any(row[3] for row in rows):
                raise RuntimeError(_sparse_message(where, sparse))
            return
        mine = _Description(
            max_bytes,
            {e.fqn: d for e, d in zip(layout.entries, layout.descriptions)},
            {e.fqn: _STATE_NAMES[s] for e, s in zip(layout.entries, states)},
            dict(d.split("\0", 1) for d in deviations),
            sparse,
        )
        found: list[_Description | None] = [None] * size
        dist.all_gather_object(found, mine, group=ctx.group)
        raise RuntimeError(_disagreement_message(where, ctx.ranks, found))  # type: ignore[arg-type]

    return finish


# Per-entry gradient states of one call (one byte each).
_NO_GRAD, _SYNC, _SPARSE, _SKIP = 0, 1, 2, 3


_STATE_NAMES = {_NO_GRAD: "no grad", _SYNC: "grad", _SPARSE: "sparse grad", _SKIP: "grad not TP-replicated"}


@dataclass(frozen=True)
class _Description:
    """What a rank was about to do, for naming the differences."""

    max_bytes: int
    entries: dict[str, str]
    states: dict[str, str]
    grads: dict[str, str]  # grads that differ from their parameter: dtype, shape, placements
    sparse: list[str]


def _sparse_message(where: str, fqns: list[str]) -> str:
    return (
        f"{where}: sparse gradients on TP-replicated parameters {fqns} (on at least one TP peer) "
        "cannot be flattened into a reduction buffer; use dense gradients for them (e.g. "
        "nn.Embedding(sparse=False)) or exclude their module with exclude_from_tp_replica_sync. "
        "No gradient was modified."
    )


def _disagreement_message(where: str, ranks: tuple[int, ...], found: list[_Description]) -> str:
    """One message, the same on every peer, naming every difference."""
    sparse = sorted({f for d in found for f in d.sparse})
    if sparse:
        return _sparse_message(where, sparse)
    lines: list[str] = []
    sizes = [d.max_bytes for d in found]
    if len(set(sizes)) > 1:
        lines.append("max_bytes: " + ", ".join(f"rank {r}: {s}" for r, s in zip(ranks, sizes)))
    fqns = sorted({f for d in found for f in d.entries})
    presence: list[str] = []
    for fqn in fqns:
        entry = [d.entries.get(fqn, "absent") for d in found]
        if len(set(entry)) > 1:
            lines.append(f"{fqn}: " + ", ".join(f"rank {r}: {e}" for r, e in zip(ranks, entry)))
            continue
        state = [d.states.get(fqn, "absent") for d in found]
        grad = [d.grads.get(fqn, "") for d in found]
        if len(set(state)) > 1 and set(state) <= {"no grad", "grad"}:
            presence.append(fqn)
        elif len(set(state)) > 1 or len(set(grad)) > 1:
            lines.append(
                f"{fqn} gradient: " + ", ".join(f"rank {r}: {s} {g}".rstrip() for r, s, g in zip(ranks, state, grad))
            )
    if presence and not lines:
        return (
            f"{where}: gradient presence differs across TP peers {list(ranks)} for {presence}: some "
            "peers have a gradient and others None. Reducing anyway would hang the peers that skip "
            "the collective. Make every TP rank run the same modules (or zero-fill unused "
            "gradients) before synchronizing. No gradient was modified."
        )
    if presence:
        lines.append(f"gradient present on some peers only: {presence}")
    return (
        f"{where}: TP peers {list(ranks)} disagree on what to communicate:\n  "
        + "\n  ".join(lines)
        + "\nEvery TP rank must pass the same model parts (same parameters, shapes, dtypes, "
        "placements, reduction marks and exclusions) and the same max_bytes. Nothing was "
        "communicated or modified."
    )
