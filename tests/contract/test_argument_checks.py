"""Every public function checks its arguments' types first and names the
argument and what it expected (TypeError/ValueError), before any change."""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

from unchanged import assert_unchanged, state_of

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def small() -> Decoder:
    return Decoder(DecoderConfig(vocab=16, dim=8, hidden=16, layers=2))


def test_apply_plan_names_a_mesh_that_is_not_a_device_mesh() -> None:
    model = small()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    before = state_of(model)
    with pytest.raises(TypeError, match="apply_plan: mesh must be a torch DeviceMesh.*got str 'mesh'"):
        fsdptx.apply_plan(p, model, "mesh")  # type: ignore[arg-type]
    assert_unchanged(before, state_of(model))


CALLS: dict[str, tuple[Callable[[], object], type[Exception], str]] = {
    "fully_shard_by_dtype(None)": (
        lambda: fsdptx.fully_shard_by_dtype(None, object(), None, None),  # type: ignore[arg-type]
        TypeError, "fully_shard_by_dtype: module must be a torch.nn.Module, got NoneType",
    ),
    "fully_shard_by_dtype(mesh='mesh')": (
        lambda: fsdptx.fully_shard_by_dtype(small(), "mesh", None, None),  # type: ignore[arg-type]
        TypeError, "fully_shard_by_dtype: mesh must be a torch DeviceMesh",
    ),
    "configure_fsdp_unused_param_reduction(None)": (
        lambda: fsdptx.configure_fsdp_unused_param_reduction(None),  # type: ignore[arg-type]
        TypeError, "configure_fsdp_unused_param_reduction: module must be a torch.nn.Module",
    ),
    "mark_tp_replica_gradient_reduction(None)": (
        lambda: fsdptx.mark_tp_replica_gradient_reduction(None, "mean"),  # type: ignore[arg-type]
        TypeError, "mark_tp_replica_gradient_reduction: module must be a torch.nn.Module, got NoneType",
    ),
    "mark_tp_replica_gradient_reduction('x')": (
        lambda: fsdptx.mark_tp_replica_gradient_reduction("x", "mean"),  # type: ignore[arg-type]
        TypeError, "mark_tp_replica_gradient_reduction: module must be a torch.nn.Module, got str",
    ),
    "mark_reduction(reductions=list)": (
        lambda: fsdptx.plan(small(), functools.partial(fsdptx.mark_reduction, reductions=["layers.*.attn_norm"])),
        TypeError, "mark_reduction: reductions must be a mapping.*got list",
    ),
    "mark_reduction(reductions='x')": (
        lambda: fsdptx.plan(small(), functools.partial(fsdptx.mark_reduction, reductions="x")),
        TypeError, "mark_reduction: reductions must be a mapping.*got str",
    ),
    "compose(None)": (
        lambda: fsdptx.compose(None),  # type: ignore[arg-type]
        TypeError, r"compose: transforms\[0\] must be callable",
    ),
    "reject_unsupported_mtp_cp_pp(pp_size='2')": (
        lambda: fsdptx.reject_unsupported_mtp_cp_pp(small(), pp_size="2"),  # type: ignore[arg-type]
        TypeError, "pp_size must be an int or None, got '2'",
    ),
    "fully_shard_across_blocks(None)": (
        lambda: fsdptx.fully_shard_across_blocks(None, ["sinks"], object(), None, None),  # type: ignore[arg-type]
        TypeError, "fully_shard_across_blocks: blocks must be an iterable of the blocks",
    ),
    "fully_shard_across_blocks([None])": (
        lambda: fsdptx.fully_shard_across_blocks([None], ["sinks"], object(), None, None),  # type: ignore[list-item]
        TypeError, r"blocks\[0\] is NoneType",
    ),
    "fully_shard_across_blocks([block, 3])": (
        lambda: fsdptx.fully_shard_across_blocks([small().layers[0], 3], ["sinks"], object(), None, None),  # type: ignore[list-item]
        TypeError, r"blocks\[1\] is int",
    ),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_public_function_names_the_bad_argument(call: str) -> None:
    fn, error, match = CALLS[call]
    with pytest.raises(error, match=match):
        fn()


@pytest.mark.parametrize("bad", [1.5, math.nan, None, "x", 0, True], ids=["float", "nan", "None", "str", "zero", "bool"])
def test_gradient_chunks_names_a_bad_max_bytes_at_the_call(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="gradient_chunks: max_bytes must be (a )?positive"):
        fsdptx.gradient_chunks([torch.zeros(4)], max_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["bf16", None, 3], ids=["str", "None", "int"])
def test_dtype_helpers_refuse_what_is_not_a_dtype(bad: object) -> None:
    with pytest.raises(TypeError, match="mp_policy_with_param_dtype: param_dtype must be a torch.dtype"):
        fsdptx.mp_policy_with_param_dtype(BF16, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gradient_reduce_dtype: dtype must be a torch.dtype"):
        fsdptx.gradient_reduce_dtype(bad)  # type: ignore[arg-type]


def test_tp_sync_with_too_small_a_budget_changes_no_gradient() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        with pytest.raises(ValueError, match="max_bytes=2 cannot hold one torch.float32 element"):
            fsdptx.synchronize_tp_replica_gradients([model], mesh, max_bytes=2)
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))


class _Holder(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.zeros(4, dtype=dtype), requires_grad=dtype.is_complex)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.value
        return (v.real if v.is_complex() else v).to(x.dtype)


class _WithOwnDtype(nn.Module):
    """A linear beside a submodule holding one non-floating (int or complex) parameter."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.layers = nn.ModuleList([_Holder(dtype)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.layers[0](x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_non_floating_parameter_keeps_its_own_dtype(dtype: torch.dtype) -> None:
    transform = functools.partial(fsdptx.shard_by_dtype, blocks=["layers.0"])
    p = fsdptx.plan(_WithOwnDtype(dtype), transform, mp_policy=BF16)
    (unit,) = [u for u in p.units if u.modules == ("layers.0",)]
    assert unit.compute_dtype in (None, dtype)
    assert unit.mp_policy is not None
    assert unit.mp_policy.param_dtype is None and unit.mp_policy.reduce_dtype is None


def test_model_with_a_complex_parameter_plans_and_applies() -> None:
    model = _WithOwnDtype(torch.complex64)
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=BF16), mesh).parallelize(model)
        assert model.layers[0].value.dtype == torch.complex64
        assert model(torch.ones(2, 4)).shape == (2, 4)


# --------------------------------------------------------------------------- every argument of every public function


class _Wrong:
    """A value of a type no argument of a public function takes."""

    def __repr__(self) -> str:
        return "<wrong>"


WRONG = _Wrong()


def _meta_small() -> Decoder:
    with torch.device("meta"):
        return small()


def _call_with(ctx: dict[str, Any], name: str) -> tuple[Callable[..., object], list[object], dict[str, object]]:
    """A valid call of the public function ``name``: the function, its
    positional arguments (in the order of ARGUMENTS[name]) and keywords."""
    mesh, model = ctx["mesh"], small()
    p = fsdptx.plan(small(), fsdptx.shard_by_dtype)
    manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(), mesh)
    noop = lambda *a, **k: None  # noqa: E731
    t = torch.zeros(2)
    calls: dict[str, tuple[Callable[..., object], list[object], dict[str, object]]] = {
        "caches": (fsdptx.caches, [], {"enabled": True}),
        "get_internal_fsdp_mp_policy": (fsdptx.get_internal_fsdp_mp_policy, [BF16], {}),
        "get_module_from_path": (fsdptx.get_module_from_path, [model, "layers.0"], {}),
        "gradient_chunks": (fsdptx.gradient_chunks, [[t]], {"max_bytes": 64}),
        "gradient_reduce_dtype": (fsdptx.gradient_reduce_dtype, [torch.bfloat16], {}),
        "group_params_by_dtype": (fsdptx.group_params_by_dtype, [model], {"dtype_of": lambda x: x.dtype, "ignored_params": set()}),
        "iter_maximal_uniform_dtype_subtrees": (
            fsdptx.iter_maximal_uniform_dtype_subtrees,
            [model],
            {"include_buffers": True, "tensor_pred": lambda x: True, "dtype_of": lambda x: x.dtype, "return_paths": False},
        ),
        "iter_unique_named_buffers": (fsdptx.iter_unique_named_buffers, [[model]], {}),
        "iter_unique_named_parameters": (fsdptx.iter_unique_named_parameters, [[model]], {}),
        "make_compute_dtype_fn": (fsdptx.make_compute_dtype_fn, [model, BF16], {"fp32_compute_module_names": ("sinks",), "ignored_params": set()}),
        "mp_policy_with_param_dtype": (fsdptx.mp_policy_with_param_dtype, [BF16, torch.float32], {}),
        "checkpoint_activations": (fsdptx.checkpoint_activations, [model, p], {"mode": "full", "blocks": ("layers.*",)}),
        "compose": (fsdptx.compose, [fsdptx.shard_by_dtype], {}),
        "diff_plans": (fsdptx.diff_plans, [p, p], {}),
        "expert_parallel": (fsdptx.expert_parallel, [model, p], {"expert_modules": (), "ep": None}),
        "mark_reduction": (fsdptx.mark_reduction, [model, p], {"reductions": {}, "exclude": ()}),
        "plan": (fsdptx.plan, [model, fsdptx.shard_by_dtype], {"mp_policy": BF16, "offload_policy": None, "reshard_after_forward": None}),
        "plan_from_json": (fsdptx.plan_from_json, [fsdptx.plan_to_json(p)], {}),
        "plan_to_json": (fsdptx.plan_to_json, [p], {}),
        "prefetch": (fsdptx.prefetch, [model, p], {"forward_depth": 1, "backward_depth": 2}),
        "reduce_unused_params": (fsdptx.reduce_unused_params, [model, p], {}),
        "reshard_policy": (fsdptx.reshard_policy, [model, p], {"pipeline_parallel": False}),
        "shard_across_blocks": (fsdptx.shard_across_blocks, [model, fsdptx.Plan()], {"blocks": ("layers.*",), "module_names": ("attn",)}),
        "shard_by_dtype": (
            fsdptx.shard_by_dtype,
            [model, fsdptx.Plan()],
            {"blocks": ("layers.*",), "fp32_compute_module_names": (), "ignored_params": (), "reshard_after_forward": None, "expert_modules": ()},
        ),
        "audit_replicas": (fsdptx.audit_replicas, [[model], mesh], {"atol": 0.0, "rtol": 0.0, "buffers": False, "tp_axis_name": "tp"}),
        "audit_replicas_every": (
            fsdptx.audit_replicas_every,
            [torch.optim.SGD(model.parameters(), lr=0.1), [model], mesh, 2],
            {"on_drift": None, "audit": fsdptx.audit_replicas},
        ),
        "broadcast_tp_replicas": (fsdptx.broadcast_tp_replicas, [[model], mesh, "tp"], {"max_bytes": 1024}),
        "exclude_from_tp_replica_sync": (fsdptx.exclude_from_tp_replica_sync, [model], {}),
        "is_tp_replicated": (fsdptx.is_tp_replicated, [t, [0, 1], 0, "tp"], {}),
        "mark_tp_replica_gradient_reduction": (fsdptx.mark_tp_replica_gradient_reduction, [model, "mean"], {}),
        "synchronize_tp_replica_gradients": (fsdptx.synchronize_tp_replica_gradients, [[model], mesh, "tp"], {"max_bytes": 1024}),
        "tensor_parallel": (
            fsdptx.tensor_parallel,
            [model, fsdptx.Plan()],
            {"plan": {}, "sequence_parallel": False, "loss_parallel": False, "blocks": ("layers.*",), "moe_mesh_experts": ()},
        ),
        "apply_plan": (
            fsdptx.apply_plan,
            [p, small(), mesh],
            {"moe_mesh": None, "shard_module": noop, "parallelize_module": noop, "checkpoint_module": noop, "hand_ep_mesh": noop},
        ),
        "check_plan": (fsdptx.check_plan, [p, small()], {}),
        "configure_fsdp_unused_param_reduction": (fsdptx.configure_fsdp_unused_param_reduction, [model], {}),
        "ParameterSet": (fsdptx.ParameterSet, [[]], {}),
        "fully_shard_across_blocks": (
            fsdptx.fully_shard_across_blocks,
            [small().layers, ("attn",), mesh, BF16, None],
            {"shard_module": noop},
        ),
        "fully_shard_by_dtype": (fsdptx.fully_shard_by_dtype, [small(), mesh, BF16, None, (), None, None], {"shard_module": noop}),
        "reject_unsupported_mtp_cp": (fsdptx.reject_unsupported_mtp_cp, [model], {}),
        "reject_unsupported_mtp_cp_pp": (fsdptx.reject_unsupported_mtp_cp_pp, [model, 2], {}),
        "FSDP2Manager": (fsdptx.FSDP2Manager, [fsdptx.FSDP2Config(), mesh, None], {}),
        "FSDP2Manager.plan": (manager.plan, [small()], {}),
        "FSDP2Manager.parallelize": (manager.parallelize, [small()], {}),
        "FSDP2Manager.maybe_compile": (manager.maybe_compile, [small()], {}),
        "FSDP2Manager.gradient_sync_context": (manager.gradient_sync_context, [small(), False], {}),
        "gradient_sync_context": (fsdptx.gradient_sync_context, [small(), False], {"defer": True}),
        "estimate_memory": (fsdptx.estimate_memory, [manager, _meta_small()], {"batch": 1, "seq": 4, "optimizer": "adamw", "cp_rotate": "allgather", "routing_skew": 1.0}),
        "estimate_pipeline_memory": (
            fsdptx.estimate_pipeline_memory,
            [fsdptx.FSDP2Manager(fsdptx.FSDP2Config(pipeline_parallel=fsdptx.PipelineParallelConfig()), ctx["pp_mesh"]), _meta_small()],
            {"batch": 2, "seq": 4, "optimizer": "adamw", "cp_rotate": "allgather"},
        ),
        "plan_pipeline": (
            fsdptx.plan_pipeline,
            [small(), fsdptx.shard_by_dtype, fsdptx.PipelineParallelConfig()],
            {"pp": 2, "blocks": None, "mp_policy": None, "offload_policy": None, "reshard_after_forward": None, "index": None},
        ),
        "apply_pipeline": (
            fsdptx.apply_pipeline,
            [p, small(), mesh],
            {
                "loss_fn": noop,
                "moe_mesh": None,
                "shard_module": noop,
                "parallelize_module": noop,
                "checkpoint_module": noop,
                "hand_ep_mesh": noop,
                "make_stage": noop,
            },
        ),
        "clip_grad_norm_": (fsdptx.clip_grad_norm_, [small(), 1.0], {"norm_type": 2.0, "error_if_nonfinite": False}),
    }
    return calls[name]


# Each public function (and the manager's methods) with its arguments in
# order; a mesh argument is checked with torch's own primitive (a
# substituted primitive may take its framework's own mesh object).
ARGUMENTS: dict[str, tuple[str, ...]] = {
    "caches": ("enabled",),
    "get_internal_fsdp_mp_policy": ("mp_policy",),
    "get_module_from_path": ("root", "path"),
    "gradient_chunks": ("tensors", "max_bytes"),
    "gradient_reduce_dtype": ("dtype",),
    "group_params_by_dtype": ("module", "dtype_of", "ignored_params"),
    "iter_maximal_uniform_dtype_subtrees": ("module", "include_buffers", "tensor_pred", "dtype_of", "return_paths"),
    "iter_unique_named_buffers": ("model_parts",),
    "iter_unique_named_parameters": ("model_parts",),
    "make_compute_dtype_fn": ("module", "mp_policy", "fp32_compute_module_names", "ignored_params"),
    "mp_policy_with_param_dtype": ("mp_policy", "param_dtype"),
    "checkpoint_activations": ("model", "plan", "mode", "blocks"),
    "compose": ("transforms",),
    "diff_plans": ("a", "b"),
    "expert_parallel": ("model", "plan", "expert_modules", "ep"),
    "mark_reduction": ("model", "plan", "reductions", "exclude"),
    "plan": ("model", "transform", "mp_policy", "offload_policy", "reshard_after_forward"),
    "plan_from_json": ("text",),
    "plan_to_json": ("plan",),
    "prefetch": ("model", "plan", "forward_depth", "backward_depth"),
    "reduce_unused_params": ("model", "plan"),
    "reshard_policy": ("model", "plan", "pipeline_parallel"),
    "shard_across_blocks": ("model", "plan", "blocks", "module_names"),
    "shard_by_dtype": ("model", "plan", "blocks", "fp32_compute_module_names", "ignored_params", "reshard_after_forward", "expert_modules"),
    "audit_replicas": ("model_parts", "device_mesh", "atol", "rtol", "buffers", "tp_axis_name"),
    "audit_replicas_every": ("optimizer", "model_parts", "device_mesh", "every", "on_drift", "audit"),
    "broadcast_tp_replicas": ("model_parts", "device_mesh", "tp_axis_name", "max_bytes"),
    "exclude_from_tp_replica_sync": ("module",),
    "is_tp_replicated": ("tensor", "tp_group_ranks", "current_rank", "tp_axis_name"),
    "mark_tp_replica_gradient_reduction": ("module", "reduction"),
    "synchronize_tp_replica_gradients": ("model_parts", "device_mesh", "tp_axis_name", "max_bytes"),
    "tensor_parallel": ("model", "current", "plan", "sequence_parallel", "loss_parallel", "blocks", "moe_mesh_experts"),
    "apply_plan": ("plan", "model", "mesh", "moe_mesh", "shard_module", "parallelize_module", "checkpoint_module", "hand_ep_mesh"),
    "check_plan": ("plan", "model"),
    "configure_fsdp_unused_param_reduction": ("module",),
    "ParameterSet": ("items",),
    "fully_shard_across_blocks": ("blocks", "module_names", "mesh", "mp_policy", "offload_policy", "shard_module"),
    "fully_shard_by_dtype": (
        "module", "mesh", "mp_policy", "offload_policy", "fp32_compute_module_names", "reshard_after_forward",
        "ignored_params", "shard_module",
    ),
    "reject_unsupported_mtp_cp": ("model",),
    "reject_unsupported_mtp_cp_pp": ("model", "pp_size"),
    "FSDP2Manager": ("config", "device_mesh", "moe_mesh"),
    "FSDP2Manager.plan": ("model",),
    "FSDP2Manager.parallelize": ("model", "loss_fn"),
    "FSDP2Manager.maybe_compile": ("model",),
    "FSDP2Manager.gradient_sync_context": ("model", "is_optimizer_step"),
    "gradient_sync_context": ("model", "is_optimizer_step", "defer"),
    "estimate_memory": ("manager", "model", "batch", "seq", "optimizer", "cp_rotate", "routing_skew"),
    "estimate_pipeline_memory": ("manager", "model", "batch", "seq", "optimizer", "cp_rotate"),
    "plan_pipeline": (
        "model", "transform", "config", "pp", "blocks", "mp_policy", "offload_policy", "reshard_after_forward", "index",
    ),
    "apply_pipeline": (
        "plan", "model", "mesh", "loss_fn", "moe_mesh", "shard_module", "parallelize_module", "checkpoint_module",
        "hand_ep_mesh", "make_stage",
    ),
    "clip_grad_norm_": ("model_or_stages", "max_norm", "norm_type", "error_if_nonfinite"),
}

# Public names that are not functions taking arguments: constants, types
# and records (their fields are data, checked where a Plan is checked), the
# two argument-free functions, and FSDP2Config (every field: test_manager_config.py).
NOT_IN_THE_TABLE = frozenset(
    {
        "DEFAULT_MAX_BUFFER_BYTES", "PlanningError", "PlanMismatchError", "Checkpointing", "ExpertParallel", "Plan",
        "PlanDiff", "Prefetch", "Reduction", "TPAssignment", "TensorParallel", "Transform", "Unit", "Drift",
        "ReplicaAudit", "MemoryEstimate", "PipelineMemoryEstimate", "PipelineRankMemory", "clear_caches", "loss_parallel", "patch_is_packed_sequence", "FSDP2Config",
        # Pipeline records and config (PipelineParallelConfig's fields: tests/manager/test_pipeline_refusals.py)
        # and the stages object parallelize returns.
        "Pipeline", "Stage", "PipelineParallelConfig", "PipelineStages",
    }
)


def test_the_table_covers_every_argument_of_every_public_function() -> None:
    import inspect

    public = set(fsdptx.__all__) - NOT_IN_THE_TABLE
    assert public == {n for n in ARGUMENTS if "." not in n}
    for name, arguments in ARGUMENTS.items():
        owner, _, method = name.partition(".")
        fn = getattr(getattr(fsdptx, owner), method) if method else getattr(fsdptx, owner)
        declared = [a for a in inspect.signature(fn).parameters if a not in ("self", "audit_kwargs")]
        assert tuple(declared) == arguments, name


@pytest.fixture
def ctx() -> Iterator[dict[str, Any]]:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        yield {"mesh": mesh, "pp_mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))}


def _enter(result: object) -> None:
    """A context manager validates when entered; everything else when called
    (an iterator must not wait for its first ``next()``)."""
    if isinstance(result, contextlib.AbstractContextManager):
        with result:
            pass


@pytest.mark.parametrize(("name", "argument"), [(n, a) for n, args in ARGUMENTS.items() for a in args])
def test_a_wrong_type_is_refused_by_the_function_itself_naming_the_argument(
    ctx: dict[str, Any], name: str, argument: str
) -> None:
    fn, args, kwargs = _call_with(ctx, name)
    position = ARGUMENTS[name].index(argument)
    if position < len(args):
        args[position] = WRONG
    else:
        kwargs[argument] = WRONG
    if argument == "mesh":
        kwargs.pop("shard_module", None)
    with pytest.raises((TypeError, ValueError)) as info:
        _enter(fn(*args, **kwargs))
    message = str(info.value)
    assert message.startswith(f"{name}: "), message
    assert re.search(rf"\b{re.escape(argument)}\b", message), message
