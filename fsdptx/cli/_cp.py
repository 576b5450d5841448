"""Context parallelism in the traced step: what is traced, what is modelled.

torch's ring attention (``context_parallel``) has no CPU path, so a CP step
cannot run under the dry run's ``FakeTensorMode``. What a CP rank holds is
nonetheless mostly a plain step: with torchtitan's (and NeMo's) head-tail
load balancing each of the ``cp`` ranks holds ``seq / cp`` tokens of every
activation (two chunks of ``seq / (2 cp)``), and ring attention saves only
the local query, key, value, output and log-sum-exp for backward, what a
local attention over ``seq / cp`` tokens saves. So the step is traced at
``seq / cp`` (parameters, gradients and optimizer state stay sharded over
``dp x cp``, exactly as applied), and only ring attention's rotation
buffers, which no local kernel allocates, are added from a closed form:

- ``allgather`` (torch's default, ``_cp_options.rotate_method``): one
  all-gather of the whole sequence's K and V per attention call, held
  while the layer's attention runs: ``batch x seq x (K + V width) x bytes``;
- ``alltoall``: the chunk being sent and the one received in flight,
  ``2 x batch x seq/cp x (K + V width) x bytes``;
- in backward, besides that K/V buffer, torch rotates dK and dV by
  all-to-all in fp32 (``convert_to_f32``): two fp32 chunks in flight.

K and V widths are the out features of each attention module's key and
value projections on this TP rank (GQA and TP included: a colwise split
divides them by ``tp``), in the compute dtype of the unit owning them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from ..core._torch_internals import CHECKPOINT_WRAPPED
from ._common import _tp_dim
from ._ring import AttentionLayer, RingAttention
from ._trace import RING_BUFFERS, Sample, Trace

__all__ = [
    "ROTATE_METHODS",
    "attention_projections",
    "cp_seq_error",
    "no_attention_error",
    "ring_attention",
    "with_ring_buffers",
]

ROTATE_METHODS = ("allgather", "alltoall")
"""torch's ``set_rotate_method`` values; ``allgather`` is its default."""

KEY_NAMES = ("k_proj", "wk", "key")
VALUE_NAMES = ("v_proj", "wv", "value")
"""Child names of an attention's key / value projections (Hugging Face,
torchtitan/Meta, BERT-style): an ``nn.Linear`` under each marks an attention."""

def cp_seq_error(seq: int, cp: int, tp: int, sequence_parallel: bool) -> str | None:
    """Why ``seq`` cannot be split over ``cp`` ranks (None when it can):
    head-tail balancing cuts it into ``2 x cp`` chunks, and sequence
    parallelism splits each rank's ``seq / cp`` over ``tp`` ranks."""
    if cp <= 1:
        return None
    sp = sequence_parallel and tp > 1
    split = 2 * cp * (tp if sp else 1)
    if seq % split == 0:
        return None
    why = f"2 x cp = {2 * cp} head-tail load-balancing chunks" + (
        f", each rank's seq/cp split over tp={tp} by sequence parallelism" if sp else ""
    )
    fitting = max(split, seq // split * split)
    return f"seq={seq} is not divisible by {split} ({why}); use a multiple of {split} such as {fitting}"


def _clean(fqn: str) -> str:
    """``fqn`` as the Plan names it: checkpointing inserts a wrapper segment."""
    return fqn.replace(f".{CHECKPOINT_WRAPPED}", "").replace(f"{CHECKPOINT_WRAPPED}.", "")


def attention_projections(model: nn.Module) -> list[tuple[str, nn.Linear, nn.Linear]]:
    """Every module with a key and a value projection: (its FQN, without
    checkpoint wrappers, the key and the value ``nn.Linear``)."""
    out = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        key = next((children[n] for n in KEY_NAMES if isinstance(children.get(n), nn.Linear)), None)
        value = next((children[n] for n in VALUE_NAMES if isinstance(children.get(n), nn.Linear)), None)
        if isinstance(key, nn.Linear) and isinstance(value, nn.Linear):
            out.append((_clean(name), key, value))
    return out


def no_attention_error(model: nn.Module) -> str:
    """The refusal of a CP trace of a model whose attention cannot be found."""
    return (
        f"a cp axis > 1 needs {type(model).__name__}'s attention layers to model ring attention's K/V "
        f"buffers (modules with nn.Linear children named {'/'.join(KEY_NAMES)} and {'/'.join(VALUE_NAMES)}), "
        "and it has none; drop --batch/--seq for the shape-only figures, or trace without cp"
    )


def _innermost(fqn: str, units: Sequence[str]) -> str:
    inside = [u for u in units if u == "" or fqn == u or fqn.startswith(u + ".")]
    return max(inside, key=len, default="")


def _per_tp_rank(linear: nn.Linear, tp: int) -> int:
    """Out features on this TP rank: a colwise split (dim 0 on ``tp``) divides them."""
    return linear.out_features // tp if _tp_dim(linear.weight) == 0 else linear.out_features


def ring_attention(
    model: nn.Module,
    plan: Any,
    *,
    cp: int,
    tp: int,
    rotate_method: str,
    batch: int,
    seq: int,
) -> RingAttention:
    """The modelled buffers of ``model`` (parallelized under ``plan``);
    ``seq`` is the whole sequence, ``batch`` sequences per rank."""
    units = [u.modules[0] for u in plan.units]
    owned = plan.owned_params
    names = {id(p): _clean(n) for n, p in model.named_parameters(remove_duplicate=False)}
    layers = []
    for fqn, key, value in attention_projections(model):
        index = owned.get(names.get(id(key.weight), ""))
        compute = None if index is None else plan.units[index].compute_dtype
        itemsize = (compute or key.weight.dtype).itemsize
        width = _per_tp_rank(key, tp) + _per_tp_rank(value, tp)
        layers.append(AttentionLayer(fqn, _innermost(fqn, units), width * itemsize, width))
    return RingAttention(cp=cp, rotate_method=rotate_method, seq=seq, batch=batch, layers=tuple(layers))


def with_ring_buffers(trace: Trace, ring: RingAttention) -> Trace:
    """``trace`` (traced at ``seq / cp``) with the ring buffers added as
    their own category to every forward and backward sample of a unit that
    runs attention: the largest buffer of the unit's layers (one attention
    call at a time), and in backward the dK/dV chunks besides. That places
    the buffer at the unit's own peak, an upper bound where the unit peaks
    outside its attention (in its MLP)."""
    forward: dict[str, int] = {}
    backward: dict[str, int] = {}
    for layer in ring.layers:
        kv = ring.kv_buffer(layer)
        forward[layer.unit] = max(forward.get(layer.unit, 0), kv)
        backward[layer.unit] = max(backward.get(layer.unit, 0), kv + ring.grad_kv_buffer(layer))
    extra = {"forward": forward, "backward": backward}

    def add(s: Sample) -> Sample:
        n = extra.get(s.phase, {}).get(s.unit, 0)
        return replace(s, bytes={**s.bytes, RING_BUFFERS: n}) if n else s

    return replace(
        trace,
        samples=tuple(add(s) for s in trace.samples),
        batch_seq=(trace.batch_seq[0], ring.seq),
        notes=(*trace.notes, ring.note()),
        ring=ring,
    )

