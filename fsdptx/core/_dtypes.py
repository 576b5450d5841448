"""Dtype resolution: which dtype a tensor computes in, and how parameters group.

Storage dtype and compute dtype are two axes. FSDP2 needs every unit to be
uniform in *storage* dtype (its "uniform original parameter dtype" assertion),
while the unit's ``param_dtype`` decides the *compute* dtype. Grouping by the
pair keeps both constraints satisfiable at once.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Hashable, Iterable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ._args import require_callable, require_dtype, require_module, require_mp_policy, require_parameters
from ._caches import process_memo
from ._names import Names, name_tokens

__all__ = [
    "LOW_PRECISION_FLOATS",
    "compute_dtype",
    "is_pinned",
    "resolve_compute_dtype",
    "gradient_reduce_dtype",
    "group_params_by_dtype",
    "make_compute_dtype_fn",
]

LOW_PRECISION_FLOATS: frozenset[torch.dtype] = frozenset(
    getattr(torch, name)
    for name in (
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
)


def gradient_reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """Communication dtype for a gradient: fp32 for low-precision floats.

    Summing many bf16/fp16 contributions loses low-order bits at every step;
    reducing in fp32 and casting back once keeps the result exact to the
    storage precision. Every other dtype is communicated as it is.

    Args:
        dtype: a gradient's dtype.

    Returns:
        ``torch.float32`` for fp16, bf16 and the fp8 kinds; ``dtype`` itself
        otherwise.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``.

    Example::

        assert fsdptx.gradient_reduce_dtype(torch.bfloat16) is torch.float32
    """
    require_dtype(dtype, "dtype", "gradient_reduce_dtype")
    return torch.float32 if dtype in LOW_PRECISION_FLOATS else dtype


def _is_lower_precision_policy(mp_policy: MixedPrecisionPolicy | None) -> bool:
    return (
        mp_policy is not None
        and mp_policy.param_dtype is not None
        and mp_policy.param_dtype.is_floating_point
        and mp_policy.param_dtype.itemsize < torch.float32.itemsize
    )


def resolve_compute_dtype(
    storage: torch.dtype,
    pinned: bool,
    hint: object,
    mp_policy: MixedPrecisionPolicy | None,
    *,
    low_precision_bulk: bool = False,
) -> torch.dtype:
    """The compute-dtype precedence on plain facts (first match wins):

    1. non-floating storage is kept (nothing to cast);
    2. ``pinned`` (a name contains a pinned token) computes in fp32: the model
       declares it intrinsically fp32 (``_keep_in_fp32_modules_strict``),
       which holds even for a model built from scratch with no checkpoint;
    3. a floating ``hint`` (``_hf_compute_dtype``, recorded at checkpoint
       load) wins next, so a checkpoint's fp32 params stay fp32 after storage
       was upcast;
    4. fp32 storage under a lower-precision policy is an fp32 master weight
       and computes in the policy's ``param_dtype`` -- unless
       ``low_precision_bulk``: in a model whose trainable bulk is stored in
       a lower precision, an fp32 parameter is no master weight but fp32 on
       purpose (GPT-OSS sinks, SSM ``A_log``/``dt_bias`` kept fp32 by the
       training script) and computes in fp32. The planner decides the bulk
       (trainable numel by storage dtype); the seed's own resolution
       (:func:`compute_dtype`) leaves it off;
    5. otherwise the storage dtype.
    """
    if not storage.is_floating_point:
        return storage
    if pinned:
        return torch.float32
    if isinstance(hint, torch.dtype) and hint.is_floating_point:
        return hint
    if storage == torch.float32 and _is_lower_precision_policy(mp_policy):
        assert mp_policy is not None and mp_policy.param_dtype is not None
        return torch.float32 if low_precision_bulk else mp_policy.param_dtype
    return storage


def is_pinned(names: Iterable[str], fp32_compute_module_names: Collection[str]) -> bool:
    """Whether any of a tensor's names contains a pinned-fp32 token."""
    search = token_search(tuple(fp32_compute_module_names))
    return search is not None and any(map(search, names))


@process_memo(limit=64)
def token_search(tokens: tuple[str, ...]) -> Callable[[str], re.Match[str] | None] | None:
    """A search for any of ``tokens`` in a name (``None`` for no tokens):
    one C-level scan per name instead of one ``in`` test per token, for the
    planner asks this of every parameter. Memoized process-wide (at most 64
    token sets, :func:`fsdptx.clear_caches`): a pipeline reuses the same
    few."""
    return re.compile("|".join(map(re.escape, tokens))).search if tokens else None


def compute_dtype(
    tensor: torch.Tensor,
    names: Iterable[str],
    mp_policy: MixedPrecisionPolicy | None,
    fp32_compute_module_names: Collection[str],
) -> torch.dtype:
    """Resolve one tensor's compute dtype from its storage, names and policy
    (precedence in :func:`resolve_compute_dtype`).

    Resolution is per tensor, so one genuinely bf16 sibling does not drag a
    module's fp32 master weights into fp32 compute.
    """
    return resolve_compute_dtype(
        tensor.dtype,
        is_pinned(names, fp32_compute_module_names),
        getattr(tensor, "_hf_compute_dtype", None),
        mp_policy,
    )


def make_compute_dtype_fn(
    module: nn.Module,
    mp_policy: MixedPrecisionPolicy | None,
    fp32_compute_module_names: Names = (),
    ignored_params: Collection[nn.Parameter] | None = None,
) -> Callable[[torch.Tensor], torch.dtype]:
    """Build a ``tensor -> compute dtype`` resolver for ``module``'s tensors.

    Names are looked up once here (every FQN of a tied tensor counts), so the
    returned function is a dictionary lookup plus :func:`compute_dtype`.
    ``ignored_params`` are left out of the name table: they belong to another
    unit and are never grouped. A tensor from outside ``module`` resolves with
    no names (rules 1 and 3-5).

    Args:
        module: the module whose parameters and buffers are resolved.
        mp_policy: the mixed-precision policy; ``None`` means disabled.
        fp32_compute_module_names: name tokens pinning fp32 compute (a
            parameter whose FQN contains one computes in fp32). A bare
            string is one token, as everywhere in fsdptx.
        ignored_params: parameters owned by another unit.

    Returns:
        ``tensor -> torch.dtype``, the compute dtype of each tensor.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or a name is not a str.

    Example::

        compute = fsdptx.make_compute_dtype_fn(block, policy, "sinks")
        groups = fsdptx.group_params_by_dtype(block, lambda t: (t.dtype, compute(t)))
    """
    where = "make_compute_dtype_fn"
    require_module(module, "module", where)
    require_mp_policy(mp_policy, "mp_policy", where)
    tokens = name_tokens(fp32_compute_module_names, "fp32_compute_module_names", where)
    ignored = set() if ignored_params is None else set(map(id, require_parameters(ignored_params, "ignored_params", where)))
    names: dict[int, list[str]] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in ignored:
            names.setdefault(id(p), []).append(fqn)
    for fqn, b in module.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), []).append(fqn)

    def resolve(tensor: torch.Tensor) -> torch.dtype:
        return compute_dtype(tensor, names.get(id(tensor), ()), mp_policy, tokens)

    return resolve


def group_params_by_dtype(
    module: nn.Module,
    dtype_of: Callable[[torch.Tensor], Hashable] | None = None,
    ignored_params: Collection[nn.Parameter] | None = None,
) -> dict[Hashable, list[nn.Parameter]]:
    """Partition ``module``'s distinct parameters by ``dtype_of`` (storage dtype
    by default), in registration order, leaving ``ignored_params`` out.

    Pass a key of ``(storage, compute)`` to get FSDP2-shardable groups.

    Args:
        module: the module whose distinct parameters are grouped.
        dtype_of: the grouping key of a parameter; its storage dtype by
            default.
        ignored_params: parameters left out of every group.

    Returns:
        key -> parameters with that key, keys in first-seen order.

    Example::

        groups = fsdptx.group_params_by_dtype(block)
        assert set(groups) <= {torch.float32, torch.bfloat16}
    """
    where = "group_params_by_dtype"
    require_module(module, "module", where)
    key_fn: Callable[[torch.Tensor], Hashable] = require_callable(dtype_of, "dtype_of", where, optional=True) or (
        lambda t: t.dtype
    )
    ignored = set() if ignored_params is None else set(map(id, require_parameters(ignored_params, "ignored_params", where)))
    groups: dict[Hashable, list[nn.Parameter]] = {}
    for p in module.parameters():
        if id(p) not in ignored:
            groups.setdefault(key_fn(p), []).append(p)
    return groups
