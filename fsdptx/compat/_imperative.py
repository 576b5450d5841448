"""Seed-compatible imperative API, built on the same planner and apply step as
the composable pipeline: each function plans, then calls ``apply_plan``."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from ..core._args import (
    require_callable,
    require_module,
    require_mp_policy,
    require_offload_policy,
    require_parameters,
)
from ..core._caches import BoundedMemo, caches_enabled, process_wide
from ..core._names import Names, name_tokens
from ..apply._apply import ShardModule, apply_resolved
from ..apply._check import check_resolved, require_mesh as _require_mesh
from ..apply._unused import configure_fsdp_unused_param_reduction
from ..model._index import ModelIndex
from ..model._unit_checks import container_classes
from ..model._walk import ModelWalk, walk_model
from ..plan.resolve import resolve_units
from ..plan._compose import check_reshard
from ..plan._plan import Plan
from ..plan._types import CrossBlockRequest, DtypeRequest, Unit

__all__ = [
    "ParameterSet",
    "configure_fsdp_unused_param_reduction",
    "fully_shard_across_blocks",
    "fully_shard_by_dtype",
    "reject_unsupported_mtp_cp",
    "reject_unsupported_mtp_cp_pp",
]


def fully_shard_by_dtype(
    module: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    fp32_compute_module_names: Names = (),
    reshard_after_forward: bool | int | None = None,
    ignored_params: Collection[nn.Parameter] | None = None,
    *,
    shard_module: ShardModule = fully_shard,
) -> None:
    """Fully shard ``module`` so every parameter computes in its required dtype.

    The bulk computes in ``mp_policy.param_dtype``; parameters that must stay
    fp32 (pinned by name, or recorded fp32 at load) get fp32 units of their
    own. Parameters group by (storage, compute) dtype: 1 group -> ``module``
    is one unit; 2 -> each maximal subtree of the smaller group alone, then
    ``module`` with the larger; 3+ -> every maximal uniform subtree alone
    (plus ``module`` when it holds parameters directly or must keep
    ``ignored_params``). A submodule holding one group directly beside
    children of another (fp32 ``sinks`` on a bf16 attention) gets its
    children's units first, then a unit owning only its direct parameters.
    Only trainable parameters must agree; frozen ones join their module's
    unit. Everything is planned first: trainable parameters of different
    groups directly on one module raise ``ValueError`` naming them before
    anything is sharded.

    ``fp32_compute_module_names`` is a sequence of name tokens; a single
    string is one token, as everywhere in fsdptx (never its characters).
    ``ignored_params`` (Parameters owned by another unit or parallelism;
    names are refused with ``TypeError``) are never grouped and are forwarded
    to the units whose subtree holds them, ``module``'s own unit included;
    a ``module`` whose parameters are all ignored still gets its unit.

    A call on a module shaped like one an earlier call planned (the next
    block of a model) takes that call's units from a memo instead of
    planning again (:class:`_CallMemo`), unless caches are off
    (:func:`fsdptx.caches`).

    Args:
        module: the module to shard (a block, or the model root last).
        mesh: the data-parallel mesh.
        mp_policy: the policy of the bulk; ``None`` means disabled.
        offload_policy: every unit's offload policy.
        fp32_compute_module_names: name tokens that compute in fp32.
        reshard_after_forward: every unit's reshard setting (``None`` is not
            passed on).
        ignored_params: Parameters owned elsewhere.
        shard_module: the FSDP primitive (``fully_shard``).

    Raises:
        TypeError: a wrong argument type (``ignored_params`` given as names).
        ValueError: parameters of different groups sit directly on one
            module; nothing was sharded.

    Example::

        for block in model.layers:
            fsdptx.fully_shard_by_dtype(block, mesh, policy, None, fp32_compute_module_names=["sinks"])
        fsdptx.fully_shard_by_dtype(model, mesh, policy, None)
    """
    where = "fully_shard_by_dtype"
    require_module(module, "module", where)
    require_callable(shard_module, "shard_module", where)
    _require_mesh(mesh, shard_module, where)
    require_mp_policy(mp_policy, "mp_policy", where)
    require_offload_policy(offload_policy, "offload_policy", where)
    tokens = name_tokens(fp32_compute_module_names, "fp32_compute_module_names", where)
    check_reshard(reshard_after_forward, where)
    request = _Call(mp_policy, offload_policy, tokens, reshard_after_forward)
    units, resolved = _plan_call(module, request, ignored_params, _CALLS if caches_enabled() else None)
    _apply_now(Plan(units=units), module, resolved, mesh, shard_module)


def _apply_now(
    plan: Plan, module: nn.Module, resolved: list[list[nn.Module]], mesh: DeviceMesh, shard_module: ShardModule
) -> None:
    """Apply units resolved from the module a moment ago: nothing can have
    changed it since, so their claims need no second walk."""
    apply_resolved(plan, module, mesh, check_resolved(plan, resolved), shard_module=shard_module)


@dataclass(frozen=True)
class _Call:
    """What one ``fully_shard_by_dtype`` call asks for, besides its module."""

    mp_policy: MixedPrecisionPolicy | None
    offload_policy: OffloadPolicy | None
    tokens: tuple[str, ...]
    reshard_after_forward: bool | int | None

    def key(self) -> tuple[object, ...] | None:
        """The call as a memo key, or ``None`` when some part is not
        hashable. The offload policy is not part of it: the planner only
        hands it to every unit, and so does a hit (the call's own object)."""
        key = (
            self.mp_policy,
            self.tokens,
            # typed: True == 1, but reshard_after_forward=1 is not True
            (type(self.reshard_after_forward), self.reshard_after_forward),
        )
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def own(self, units: tuple[Unit, ...]) -> tuple[Unit, ...]:
        """Remembered units with this call's own offload policy and
        ``reshard_after_forward``, which planning hands every unit as they
        are (a remembered call's may be equal values, or another policy)."""
        offload, reshard = self.offload_policy, self.reshard_after_forward
        return tuple(
            u
            if u.offload_policy is offload and u.reshard_after_forward is reshard
            else dataclasses.replace(u, offload_policy=offload, reshard_after_forward=reshard)
            for u in units
        )


@dataclass(frozen=True)
class _Planned:
    """A call's units, and where their modules sit in the call's walk."""

    units: tuple[Unit, ...]
    positions: tuple[tuple[int, ...], ...]


class _CallMemo(BoundedMemo[tuple[object, ...], _Planned]):
    """The units of earlier ``fully_shard_by_dtype`` calls by the shape of
    their module, the most recently used ``limit`` kept.

    A model makes one call per block and its blocks are built alike, so
    every call after the first would plan the same units again. The memo
    holds a pure function's results: the key (:func:`_shape`) holds all
    that planning one call reads (the call's settings, :meth:`_Call.key`;
    the module's tree, classes and names, and which ModuleList/ModuleDict
    classes are bare containers; each parameter's slot, dtype,
    ``requires_grad``, rank, size, compute-dtype hint and whether it is
    ignored), and a call's FQNs are relative to its module, so equal keys
    give equal units. It holds classes, policies and names, never a module
    or a parameter, so it keeps no model alive. Models may be parallelized
    from several threads of one process: :class:`BoundedMemo` is
    thread-safe.
    """


# The one process-wide memo of calls: bounded, emptied by fsdptx.clear_caches().
_CALLS = process_wide(_CallMemo(limit=64))


def _shape(walk: ModelWalk, call: tuple[object, ...], ignored: list[bool]) -> tuple[object, ...] | None:
    """What planning one call reads from its module's walk (see
    :class:`_CallMemo`), or ``None``: a module with shared submodules or
    tied parameters is planned every time (its names are not positional),
    as is one whose hints are not hashable."""
    params = walk.params
    if walk.repeats or len(set(map(id, params))) != len(params):
        return None
    shape = (
        call,
        tuple(walk.types),
        container_classes(walk.types),
        tuple(walk.parents),
        tuple(walk.names),
        tuple(walk.owners),
        tuple(walk.slot_names),
        # Everything read from a parameter, in one visit each: a fresh
        # model's parameters are not in the CPU caches.
        tuple([(p.dtype, p.requires_grad, p.ndim, p.numel(), getattr(p, "_hf_compute_dtype", None)) for p in params]),
        tuple(ignored),
    )
    try:
        hash(shape)
    except TypeError:
        return None
    return shape


def _plan_call(
    module: nn.Module, call: _Call, ignored_params: Collection[nn.Parameter] | None, memo: _CallMemo | None
) -> tuple[tuple[Unit, ...], list[list[nn.Module]]]:
    """The units of one ``fully_shard_by_dtype`` call, and their modules:
    from ``memo`` when a module of the same shape was planned before, else
    planned (and remembered)."""
    # fully_shard stops at modules sharded by earlier calls, and so does the
    # walk: the root call after N blocks does not walk into them again.
    walk = walk_model(module, enter_sharded=False)
    ignored = _ignored_slots(walk, ignored_params)
    call_key = call.key() if memo is not None else None
    shape = _shape(walk, call_key, ignored) if call_key is not None else None
    found = memo.get(shape) if memo is not None and shape is not None else None
    if found is None:
        index = ModelIndex.from_walk(module, walk)
        fqn = index.param_fqn
        request = DtypeRequest(
            targets=("",),
            fp32_compute_module_names=call.tokens,
            ignored_params=tuple(dict.fromkeys(fqn[id(p)] for p, i in zip(walk.params, ignored) if i)),
            reshard_after_forward=call.reshard_after_forward,
            always_shard_root=False,
        )
        units = resolve_units(
            module,
            mp_policy=call.mp_policy,
            offload_policy=call.offload_policy,
            cross_blocks=(),
            dtype_request=request,
            index=index,
        )
        found = _Planned(units, tuple(tuple(walk.position[id(index.modules[f])] for f in u.modules) for u in units))
        if memo is not None and shape is not None:
            memo.put(shape, found)
    return call.own(found.units), [[walk.modules[i] for i in at] for at in found.positions]


def _parameters(items: object, argument: str = "items", where: str = "ParameterSet") -> list[nn.Parameter]:
    """``items`` as a list of Parameters, refusing what would otherwise be
    silently dropped: names instead of Parameters, or one bare tensor."""
    return require_parameters(items, argument, where)


class ParameterSet(set[nn.Parameter]):
    """A set that only ever holds ``nn.Parameter`` objects.

    Every way of adding to it checks what is added, so its members are known
    to be Parameters without looking at them again. That is what keeps the
    imperative API linear: ``fully_shard_by_dtype`` over every block with one
    set of every block's ignored parameters would otherwise re-check the
    whole set once per block. Given a ``ParameterSet`` it only looks up the
    module's own parameters in it; any other collection is checked element
    by element on every call. :func:`fully_shard_across_blocks` returns one.

    Args:
        items: the initial members, each an ``nn.Parameter``.

    Example::

        owned = fsdptx.fully_shard_across_blocks(model.layers, ["sinks"], mesh, policy, None)
        for block in model.layers:
            fsdptx.fully_shard_by_dtype(block, mesh, policy, None, ignored_params=owned)
    """

    def __init__(self, items: Iterable[nn.Parameter] = ()) -> None:
        super().__init__(_parameters(items))

    def add(self, item: nn.Parameter) -> None:
        super().add(*_parameters([item]))

    def update(self, *others: Iterable[nn.Parameter]) -> None:
        super().update(*(_parameters(o) for o in others))

    def symmetric_difference_update(self, other: Iterable[nn.Parameter]) -> None:
        super().symmetric_difference_update(_parameters(other))

    def __ior__(self, other: AbstractSet[nn.Parameter]) -> ParameterSet:  # type: ignore[override, misc]
        self.update(other)
        return self

    def __ixor__(self, other: AbstractSet[nn.Parameter]) -> ParameterSet:  # type: ignore[override, misc]
        self.symmetric_difference_update(other)
        return self


def _ignored_slots(walk: ModelWalk, ignored_params: Collection[nn.Parameter] | None) -> list[bool]:
    """Per parameter slot of the walk, whether its parameter is ignored.

    A :class:`ParameterSet` is looked up per parameter of the module (its
    members are Parameters already); any other collection is checked whole.
    """
    if ignored_params is None:
        return [False] * len(walk.params)
    if isinstance(ignored_params, ParameterSet):
        return [p in ignored_params for p in walk.params]
    ids = set(map(id, _parameters(ignored_params, "ignored_params", "fully_shard_by_dtype")))
    return [id(p) in ids for p in walk.params]


def fully_shard_across_blocks(
    blocks: Iterable[nn.Module],
    module_names: Names,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    *,
    shard_module: ShardModule = fully_shard,
) -> ParameterSet:
    """Put every block's instance of each named fp32 holder into ONE FSDP unit.

    A holder whose forward ignores its input never fires FSDP2's per-unit
    post-backward hook, so N blocks' holders become N serialized
    reduce-scatters after backward; one unit across blocks makes it one. The
    unit computes and reduces in fp32, returns its natural output, and is not
    resharded after forward (a few KiB kept resident saves an all-gather per
    block and per checkpoint recompute). Checkpoint wrappers are looked
    through. A name may point at a module holding fp32 parameters directly
    beside children of other dtypes (``self_attn`` for GPT-OSS ``sinks``):
    its children get dtype units first, so the cross-block unit owns only the
    direct fp32 parameters. A single string is one name. Returns the
    parameters of every unit made here as they are after sharding (DTensor
    parameters), for use as ``ignored_params`` of the enclosing units, as a
    :class:`ParameterSet`: a ``set`` with which those calls stay linear.

    Args:
        blocks: the blocks, in order: any iterable of modules
            (``model.layers``, a list, an ``nn.ModuleDict``'s values).
        module_names: block-relative names of the holders (a bare string is
            one name).
        mesh: the data-parallel mesh.
        mp_policy: the caller's policy; the units compute in fp32 from it.
        offload_policy: the units' offload policy.
        shard_module: the FSDP primitive (``fully_shard``).

    Returns:
        The holders' parameters as a :class:`ParameterSet`.

    Raises:
        TypeError: ``blocks`` is not an iterable of modules (one module
            that is not a container, a string).
        ValueError: a name is in no block, or a matched module holds a
            parameter that is not fp32.

    Example::

        owned = fsdptx.fully_shard_across_blocks(model.layers, ["self_attn"], mesh, policy, None)
        for block in model.layers:
            fsdptx.fully_shard_by_dtype(block, mesh, policy, None, ignored_params=owned)
    """
    where = "fully_shard_across_blocks"
    blocks = _block_list(blocks)
    require_callable(shard_module, "shard_module", where)
    _require_mesh(mesh, shard_module, where)
    require_mp_policy(mp_policy, "mp_policy", where)
    require_offload_policy(offload_policy, "offload_policy", where)
    names = name_tokens(module_names, "module_names", "fully_shard_across_blocks")
    holder = nn.ModuleList(blocks)  # a view for FQNs "0.attn.sinks"; blocks are not changed
    index = ModelIndex.build(holder)
    units = resolve_units(
        holder,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        cross_blocks=(CrossBlockRequest(tuple(str(i) for i in range(len(blocks))), names),),
        dtype_request=None,
        index=index,
    )
    _apply_now(Plan(units=units), holder, [[index.modules[f] for f in u.modules] for u in units], mesh, shard_module)
    return ParameterSet(holder.get_parameter(f) for u in units for f in u.params)


def _block_list(blocks: object) -> list[nn.Module]:
    """The blocks ``fully_shard_across_blocks`` was given, as a list: any
    iterable of modules, the way callers hold them (``model.layers``, an
    ``nn.ModuleList``; the values of an ``nn.ModuleDict``; a list; a
    generator). A single module that is not a container is refused, as is a
    string: iterating either would not give the blocks."""
    where = "fully_shard_across_blocks"
    if isinstance(blocks, nn.ModuleDict):
        listed: list[object] = list(blocks.values())
    elif isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        listed = list(blocks)
    elif isinstance(blocks, nn.Module):
        raise TypeError(
            f"{where}: blocks must be an iterable of the blocks (e.g. model.layers), got one "
            f"{type(blocks).__name__} module; pass [block] for a single block"
        )
    elif isinstance(blocks, (str, bytes)) or not isinstance(blocks, Iterable):
        raise TypeError(
            f"{where}: blocks must be an iterable of the blocks (nn.Module, e.g. model.layers), "
            f"got {type(blocks).__name__}"
        )
    else:
        listed = list(blocks)
    wrong = [f"blocks[{i}] is {type(b).__name__}" for i, b in enumerate(listed) if not isinstance(b, nn.Module)]
    if wrong:
        raise TypeError(f"{where}: every block must be an nn.Module; {', '.join(wrong)}")
    return [b for b in listed if isinstance(b, nn.Module)]


def _supports(model: nn.Module, flag: str) -> bool:
    return bool(getattr(getattr(model, "supports", None), flag, False))


class _MTPContextParallelError(RuntimeError, ValueError):
    """MTP with context parallelism on a model that has not declared support.

    A ``RuntimeError``, the type the reference raises and its callers catch;
    also a ``ValueError``, the type fsdptx raised before, so callers written
    against earlier fsdptx releases keep working."""


class _MTPPipelineError(NotImplementedError, ValueError):
    """MTP with context and pipeline parallelism on a model that has not
    declared support. ``NotImplementedError`` as in the reference; also a
    ``ValueError`` for callers of earlier fsdptx releases."""


def _is_pipeline_stage(model: nn.Module, pp_size: int | None) -> bool:
    """Whether ``model`` runs as one stage of a pipeline.

    ``pp_size > 1`` says so directly. A trainer whose mesh omits the PP axis
    (the stage was trimmed before this call) passes no ``pp_size``; the
    model's legacy ``_is_pipeline_parallel_stage()`` hook still knows, so it
    is asked whenever ``pp_size`` does not already say "pipeline"."""
    if pp_size is not None and pp_size > 1:
        return True
    hook = getattr(model, "_is_pipeline_parallel_stage", None)
    return callable(hook) and bool(hook())


def reject_unsupported_mtp_cp(model: nn.Module) -> None:
    """Raise ``RuntimeError`` if multi-token prediction is enabled but the
    model has not declared context-parallel support
    (``model.supports.supports_mtp_cp``): MTP heads shift the sequence, which
    CP's sequence split would silently corrupt.

    Args:
        model: the model; ``model.supports`` is read duck-typed (a model
            without it has MTP disabled).

    Raises:
        RuntimeError: MTP is enabled without ``supports_mtp_cp``.

    Example::

        if cp_size > 1:
            fsdptx.reject_unsupported_mtp_cp(model)
    """
    require_module(model, "model", "reject_unsupported_mtp_cp")
    if _supports(model, "mtp_enabled") and not _supports(model, "supports_mtp_cp"):
        raise _MTPContextParallelError(
            f"{type(model).__name__} does not support MTP with context parallelism: multi-token "
            "prediction is enabled but the model does not declare supports.supports_mtp_cp; "
            "disable MTP or context parallelism for this model"
        )


def reject_unsupported_mtp_cp_pp(model: nn.Module, pp_size: int | None = None) -> None:
    """Raise on MTP + context parallelism + pipeline parallelism unless the model
    declares ``supports.supports_mtp_cp_pp``. Call only when CP is active.

    First the CP check of :func:`reject_unsupported_mtp_cp` (``RuntimeError``);
    then, when the model is a pipeline stage (``pp_size > 1``, or its legacy
    ``_is_pipeline_parallel_stage()`` hook returns True), ``NotImplementedError``
    without ``supports_mtp_cp_pp``. ``pp_size`` must be ``None`` or an int
    (``"2"`` would compare as text).

    Args:
        model: the model or pipeline stage.
        pp_size: the pipeline-parallel size, if known.

    Raises:
        TypeError: ``pp_size`` is neither ``None`` nor an int.
        RuntimeError: MTP with CP is not supported (the CP check).
        NotImplementedError: MTP with CP and PP is not supported.

    Example::

        if cp_size > 1:
            fsdptx.reject_unsupported_mtp_cp_pp(model, pp_size=pp_size)
    """
    require_module(model, "model", "reject_unsupported_mtp_cp_pp")
    if pp_size is not None and (isinstance(pp_size, bool) or not isinstance(pp_size, int)):
        raise TypeError(f"reject_unsupported_mtp_cp_pp: pp_size must be an int or None, got {pp_size!r}")
    reject_unsupported_mtp_cp(model)
    if (
        _supports(model, "mtp_enabled")
        and not _supports(model, "supports_mtp_cp_pp")
        and _is_pipeline_stage(model, pp_size)
    ):
        where = f"pp_size={pp_size}" if pp_size is not None and pp_size > 1 else "a trimmed pipeline stage"
        raise _MTPPipelineError(
            f"{type(model).__name__} has multi-token prediction enabled with context parallelism "
            f"and pipeline parallelism ({where}) but does not declare "
            "supports.supports_mtp_cp_pp; disable MTP, or run without pipeline parallelism"
        )
