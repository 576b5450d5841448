"""Dtype keys and unit policies: each parameter's (storage, compute) dtype
(:func:`param_keys`), the model's low-precision bulk, and the policy a
unit computing in one dtype gets (:func:`unit_policy`).

Resolved once per resolution from the facts the index recorded; a file of
its own because it reads the mixed-precision policy, which nothing else
in the planner interprets.
"""

from __future__ import annotations

import functools
from collections.abc import Collection

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from ...core._caches import memoized
from ...core._dtypes import LOW_PRECISION_FLOATS, resolve_compute_dtype, token_search
from ...core._policy import get_internal_fsdp_mp_policy, keep_storage_policy, mp_policy_with_param_dtype
from ...model._index import ModelIndex

__all__ = ["DtypeKey", "low_precision_bulk", "param_keys", "unit_policy"]

DtypeKey = tuple[torch.dtype, torch.dtype]  # (storage, compute)

def unit_policy(
    mp_policy: MixedPrecisionPolicy | None, setting: tuple[torch.dtype | None, bool]
) -> MixedPrecisionPolicy | None:
    """The policy for a unit computing in ``compute`` under ``mp_policy``
    (``None``: ``mp_policy`` as is; a non-floating dtype: no cast at all);
    ``internal`` units drop ``output_dtype``."""
    compute, internal = setting
    if compute is not None and not compute.is_floating_point:
        # Integer, bool or complex parameters: nothing to cast, and a
        # bf16 (or fp32) cast would truncate them or drop the
        # imaginary part; they compute and reduce as they are stored.
        policy = keep_storage_policy(mp_policy)
    elif compute is None:
        policy = mp_policy
    else:
        policy = mp_policy_with_param_dtype(mp_policy, compute)
    return get_internal_fsdp_mp_policy(policy) if internal else policy


def low_precision_bulk(index: ModelIndex) -> torch.dtype | None:
    """The storage dtype of the model's trainable bulk (most trainable numel;
    all parameters when none is trainable) when it is a lower-precision
    float (bf16, fp16, fp8), else ``None``. In such a model an fp32
    parameter was kept fp32 on purpose and computes in fp32
    (:func:`fsdptx._dtypes.resolve_compute_dtype`, rule 4)."""
    trainable: dict[torch.dtype, int] = {}
    every: dict[torch.dtype, int] = {}
    for (dtype, grad), n in index.numel_by_kind.items():
        if not dtype.is_floating_point:
            continue
        every[dtype] = every.get(dtype, 0) + n
        if grad:
            trainable[dtype] = trainable.get(dtype, 0) + n
    counts = trainable or every
    if not counts:
        return None
    bulk = max(counts, key=lambda d: (counts[d], str(d)))  # a tie by name: every rank decides alike
    return bulk if bulk in LOW_PRECISION_FLOATS else None

def param_keys(
    index: ModelIndex, mp_policy: MixedPrecisionPolicy | None, fp32_tokens: Collection[str]
) -> tuple[dict[int, DtypeKey], set[int], set[int]]:
    """(storage, compute) dtype of every floating parameter, the ids of
    the frozen ones among them, and the ids of the fp32 parameters that
    compute in fp32 because the model's bulk is lower precision (not pinned,
    no hint: the rule decided, and the Plan says so).

    Resolved once from the facts the index recorded (no tensor is consulted
    again); parameters with equal facts share one resolution. Integer and
    bool parameters get no key: they cannot be trainable, so they constrain
    no unit and join whichever claims them. Complex ones are keyed by their
    storage (computing as stored).
    """
    search = token_search(tuple(fp32_tokens))
    low_bulk = low_precision_bulk(index) is not None
    key_of = memoized(functools.partial(_dtype_key, mp_policy=mp_policy, low_bulk=low_bulk))
    keys: dict[int, DtypeKey] = {}
    frozen: set[int] = set()
    intrinsic: set[int] = set()
    by_bulk: DtypeKey | None = None  # the key the bulk rule gives fp32 storage, if it decides one
    if low_bulk and mp_policy is not None:
        master = resolve_compute_dtype(torch.float32, False, None, mp_policy)
        if master != torch.float32:
            by_bulk = (torch.float32, torch.float32)
    aliases, param_fqn = index.aliases, index.param_fqn
    for pid, (dtype, _n, _b, hint, grad) in index.param_facts.items():
        pinned = search is not None and (
            search(param_fqn[pid]) is not None or (pid in aliases and any(map(search, aliases[pid])))
        )
        key = key_of((dtype, pinned, hint))  # a handful of distinct facts in a whole model
        if key is None:
            continue
        keys[pid] = key
        if by_bulk is not None and key == by_bulk and not pinned and not isinstance(hint, torch.dtype):
            intrinsic.add(pid)
        if not grad:
            frozen.add(pid)
    return keys, frozen, intrinsic


def _dtype_key(
    fact: tuple[torch.dtype, bool, object], *, mp_policy: MixedPrecisionPolicy | None, low_bulk: bool
) -> DtypeKey | None:
    """The (storage, compute) key of a parameter with these facts (storage
    dtype, pinned by a token, compute-dtype hint), or ``None`` for an
    integer or bool one. Complex parameters are trainable, so FSDP2 asks a
    unit to hold them alone like any storage dtype; their compute dtype is
    their storage (resolve_compute_dtype keeps every non-floating dtype)."""
    dtype, pinned, hint = fact
    if not (dtype.is_floating_point or dtype.is_complex):
        return None
    return (dtype, resolve_compute_dtype(dtype, pinned, hint, mp_policy, low_precision_bulk=low_bulk))
