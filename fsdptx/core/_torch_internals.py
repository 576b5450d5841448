"""Every private torch API fsdptx relies on, in one place.

fsdptx pins one torch release, and private names move between releases
without a deprecation. Each one fsdptx needs is named here, with why there
is no public way, so a torch upgrade breaks in this file and nowhere else;
``tests/contract/test_torch_internals.py`` refuses a private torch name used
anywhere else in the package. Pure names and thin wrappers: the decisions
stay with the modules that call them.

What is here, by who needs it:

- applying a plan: composable ``checkpoint`` (torch's only checkpoint that
  composes with ``fully_shard`` on the same module) and its registry (has a
  module been checkpointed?), selective checkpointing's recompute mode,
  FSDP's per-unit state (and whether it is its model's root) and parameter
  groups (reduce dtypes of unused parameters, the gradient-sync flags
  ``gradient_sync_context`` restores);
- tensor parallelism: ``_StridedShard`` (a packed gate|up weight split per
  half), functional all-reduce (counted as TP traffic by tracers), a DTensor's
  local shard without ``to_local``'s autograd node, ``_foreach_copy_``; a
  tensor's view base and version counter (has a MoE block returned its
  experts' output unchanged?);
- module wrappers: the attribute names under which activation
  checkpointing, ``torch.compile`` and FSDP1 keep the module they wrap;
- meshes: ``DeviceMesh._flatten``/``_unflatten`` (HSDP over several data
  dims, a dim of one for replicate-only FSDP, the MoE mesh);
- async TP: inductor's micro-pipeline switch and symmetric memory;
- the memory plan's trace: ``FakeTensorMode``, ``FSDPMemTracker`` and two
  patches that keep its count honest and fast; an operator's name; a
  differentiable functional all-to-all (the traced step's static expert
  dispatch). The
  trace's tracker subclass (``fsdptx.cli._trace``) also overrides the
  tracker's private ``_update_peak_stats`` hook and reads its
  ``_mod_tracker``: a subclass's overrides live with the subclass;
- fake worlds for tests: torch's fake process-group store, the DTensor
  caches a closed world leaves behind, the dispatch mode and pytree that
  record collectives.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._composable import checkpoint as composable_checkpoint  # type: ignore[attr-defined]
from torch.distributed._composable.contract import _get_registry
from torch.distributed._tools import fsdp2_mem_tracker as _fsdp2_mem_tracker
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.tensor import DTensor, _redistribute, _sharding_prop
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves
from torch.utils.checkpoint import _CachedTorchDispatchMode as CachedTorchDispatchMode

__all__ = [
    "CachedTorchDispatchMode",
    "FSDPMemTracker",
    "FakeStore",
    "FakeTensorMode",
    "CHECKPOINT_WRAPPED",
    "StridedShard",
    "WRAPPER_SEGMENTS",
    "TorchDispatchMode",
    "clear_dtensor_caches",
    "composable_checkpoint",
    "composable_registry",
    "enable_symmetric_memory",
    "fake_device",
    "fast_fake_mode_lookup",
    "foreach_copy_",
    "fsdp_is_root",
    "fsdp_param_groups",
    "fsdp_state",
    "functional_all_reduce",
    "functional_all_to_all",
    "local_tensor",
    "flatten_mesh",
    "micro_pipeline_tp",
    "op_name",
    "op_schema_name",
    "own_propagation_fake_mode",
    "resolve_process_group",
    "set_micro_pipeline_tp",
    "tree_flatten",
    "tree_leaves",
    "unflatten_mesh",
    "tensor_base",
    "unsharded_param",
    "version_counter",
]

# --------------------------------------------------------------------------- applying a plan


def composable_registry(module: nn.Module) -> Mapping[str, Any] | None:
    """The composable APIs applied to ``module`` (``"checkpoint"``,
    ``"fully_shard"``), or ``None``: how torch itself tells."""
    registry: Mapping[str, Any] | None = _get_registry(module)
    return registry


def fsdp_state(module: nn.Module) -> Any:
    """The ``fully_shard`` state of an FSDP module, shared by every module
    of a multi-module unit (so its identity names the unit)."""
    return module._get_fsdp_state()  # type: ignore[operator]


def fsdp_is_root(state: Any) -> bool | None:
    """Whether an FSDP state is its model's root: ``True`` or ``False`` once
    the first forward has run (FSDP decides it then: the state whose module
    runs forward first), ``None`` before. There is no public accessor."""
    is_root: bool | None = state._is_root
    return is_root


def fsdp_param_groups(state: Any) -> list[Any]:
    """The parameter groups of an FSDP state: where FSDP keeps each unit's
    reduce dtype, accumulated gradients and gradient-sync flags."""
    groups: list[Any] = state._fsdp_param_groups
    return groups


def unsharded_param(fsdp_param: Any) -> nn.Parameter | None:
    """An FSDP parameter's unsharded parameter, or ``None`` before the
    first all-gather created it."""
    return getattr(fsdp_param, "_unsharded_param", None)


# --------------------------------------------------------------------------- tensor parallelism


def functional_all_reduce(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of ``t`` over ``group``, out of place, as a functional
    collective like DTensor's own: tools that tell TP traffic from FSDP's
    (the memory plan's trace) count it as TP."""
    out = funcol.all_reduce(t.contiguous(), "sum", group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def functional_all_to_all(
    t: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """``all_to_all_single`` of ``t``'s rows over ``group``, out of place and
    differentiable (its backward is the reverse exchange), waited on: the
    public ``all_to_all_single`` is in-place and has no autograd, and its
    autograd twin is the functional one transformers' EP dispatch uses."""
    out: torch.Tensor = funcol.all_to_all_single_autograd(t.contiguous(), output_sizes, input_sizes, group)
    waited: torch.Tensor = funcol.wait_tensor(out)
    return waited


# A DTensor's local shard without ``to_local``'s autograd node (DTensors only): for reading
# and reducing gradients in place, where an autograd view would be wrong.
local_tensor: Callable[[torch.Tensor], torch.Tensor] = operator.attrgetter("_local_tensor")

# One fused kernel for many copies (the TP-replica sync's pack and unpack).
foreach_copy_: Callable[[list[torch.Tensor], list[torch.Tensor]], None] = torch._foreach_copy_


def tensor_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``t`` views (``t`` itself if not a view, and
    under ``torch.inference_mode()``, which keeps no view bases)."""
    base = t._base
    return t if base is None else base


def version_counter(t: torch.Tensor) -> int | None:
    """``t``'s version counter, bumped by every in-place change of its
    storage (a view shares its base's); ``None`` for an inference tensor,
    which keeps none."""
    return None if t.is_inference() else t._version


def resolve_process_group(group: Any) -> dist.ProcessGroup:
    """The process group a collective's argument names (a group object or
    a functional collective's group name); raises ``RuntimeError`` for
    anything else."""
    resolved: dist.ProcessGroup = dist.distributed_c10d._resolve_process_group(group)  # type: ignore[attr-defined]
    return resolved


# --------------------------------------------------------------------------- module wrappers

# The attribute under which ``checkpoint_wrapper`` keeps the wrapped module.
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"

# Path segments of wrappers that hold the real module: activation
# checkpointing's, ``torch.compile``'s ``OptimizedModule`` and FSDP1's.
WRAPPER_SEGMENTS = frozenset({CHECKPOINT_WRAPPED, "_orig_mod", "_fsdp_wrapped_module"})


# --------------------------------------------------------------------------- meshes


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dims as one dim called ``name`` (FSDP shards over one dim)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh`` with dim ``dim`` split into dims of ``sizes`` called ``names``."""
    return mesh._unflatten(dim, sizes, names)


# --------------------------------------------------------------------------- async TP


def micro_pipeline_tp() -> bool:
    """Inductor's micro-pipelined TP switch (async TP's compiler pass)."""
    import torch._inductor.config as inductor_config  # importing inductor costs seconds: only when asked

    value: bool = inductor_config._micro_pipeline_tp
    return value


def set_micro_pipeline_tp(value: bool) -> None:
    """Set inductor's micro-pipelined TP switch."""
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = value


def enable_symmetric_memory(group_name: str) -> None:
    """Enable symmetric memory for a process group (async TP's collectives
    need it); raises ``ImportError`` where torch was built without it."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(group_name)  # type: ignore[arg-type]  # GroupName is a str


# --------------------------------------------------------------------------- the memory plan's trace


@contextlib.contextmanager
def fast_fake_mode_lookup() -> Iterator[None]:
    """The tracker asks for the active fake mode after every operator, by
    walking the whole mode stack (a tenth of a deep model's trace); the
    dispatcher keeps the active fake mode in a slot of its own."""
    saved = _fsdp2_mem_tracker.active_fake_mode  # type: ignore[attr-defined]
    key = torch._C._TorchDispatchModeKey.FAKE
    _fsdp2_mem_tracker.active_fake_mode = lambda: torch._C._get_dispatch_mode(key)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        _fsdp2_mem_tracker.active_fake_mode = saved  # type: ignore[attr-defined]


def fake_device(tensor: object) -> torch.device | None:
    """The device a fake tensor reports to ``prim.device`` outside its
    mode's kernels (the device it stands for), as the fake mode would answer
    it; ``None`` for anything else, which must go through dispatch."""
    if isinstance(tensor, FakeTensor) and not tensor.fake_mode.in_kernel_invocation:
        device: torch.device = tensor.fake_device
        return device
    return None


@contextlib.contextmanager
def own_propagation_fake_mode() -> Iterator[None]:
    """DTensor's sharding propagation runs under ``detect_fake_mode() or
    FakeTensorMode()``; under our fake mode it would reuse it and the tracker
    would count its shape-only tensors. Hand it a fake mode of its own."""
    own = FakeTensorMode(allow_non_fake_inputs=True)
    saved = _sharding_prop.detect_fake_mode  # type: ignore[attr-defined]
    _sharding_prop.detect_fake_mode = lambda *args: own  # type: ignore[attr-defined]
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved  # type: ignore[attr-defined]


def op_name(func: Any) -> str:
    """An operator's name without its overload (``all_reduce`` for
    ``_c10d_functional.all_reduce.default``)."""
    name: str = func._overloadpacket.__name__
    return name


def op_schema_name(func: Any) -> str:
    """An operator's qualified schema name (``c10d::allreduce_``)."""
    name: str = func._schema.name
    return name


# --------------------------------------------------------------------------- fake worlds


def clear_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation, redistribution-plan and mesh
    topology caches (what ``torch.distributed.tensor.debug``'s
    ``_clear_sharding_prop_cache`` does, without that package's numpy)."""
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
