"""FSDP2Config and FSDP2Manager refuse what the real run would refuse, at
construction or in the dry run, and keep the settings they accept frozen."""

from __future__ import annotations

import functools
import logging
import sys
import types

import pytest
import torch
import torch._inductor.config as inductor_config
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

import fsdptx
from fsdptx import FSDP2Config, FSDP2Manager
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

from unchanged import assert_unchanged, state_of


def small() -> Decoder:
    return Decoder(DecoderConfig(vocab=16, dim=8, hidden=16, layers=2))


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_config_refuses_a_non_floating_policy_dtype(field: str, dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=f"mp_policy.{field} must be a floating dtype"):
        FSDP2Config(mp_policy=MixedPrecisionPolicy(**{field: dtype}))


def test_plan_refuses_a_non_floating_policy_dtype() -> None:
    with pytest.raises(ValueError, match="plan: mp_policy.param_dtype must be a floating dtype"):
        fsdptx.plan(small(), fsdptx.shard_by_dtype, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int64))


@pytest.mark.parametrize(
    ("plan", "error", "match"),
    [
        ({"layers.*.attn.q": 3}, TypeError, r"tp_plan\['layers.\*.attn.q'\]: style must be"),
        ({3: "colwise"}, TypeError, "key 3 must be a module glob"),
        ({"layers.*.attn.q": "colwize"}, ValueError, "unknown style 'colwize'; did you mean 'colwise'"),
        ({"layers.*.attn.q": None}, TypeError, "style must be a style name or a torch ParallelStyle, got None"),
    ],
    ids=["int-style", "int-key", "typo", "none-style"],
)
def test_config_refuses_a_bad_tp_plan_entry(plan: dict[object, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        FSDP2Config(tp_plan=plan)  # type: ignore[arg-type]


def test_config_with_a_tp_plan_is_hashable_and_frozen() -> None:
    given = {"layers.*.attn.q": "colwise", "lm_head": ColwiseParallel()}
    a = FSDP2Config(tp_plan=given)
    b = FSDP2Config(tp_plan={"lm_head": given["lm_head"], "layers.*.attn.q": "colwise"})
    assert hash(a) == hash(b) and a == b
    given["layers.*.attn.q"] = "rowwise"  # the caller's dict changes; the config does not
    assert a.tp_plan is not None and a.tp_plan["layers.*.attn.q"] == "colwise"
    with pytest.raises(TypeError):
        a.tp_plan["lm_head"] = "rowwise"  # type: ignore[index]


def test_mesh_with_both_dp_and_dp_shard_is_refused_as_ambiguous() -> None:
    with fake_mesh((2, 2), ("dp", "dp_shard")) as mesh:
        with pytest.raises(ValueError, match="both 'dp' and 'dp_shard'.*ambiguous"):
            FSDP2Manager(FSDP2Config(), mesh)


def test_replicate_only_mesh_replicates_parameters() -> None:
    model = small()
    with fake_mesh((4,), ("dp_replicate",)) as mesh:
        FSDP2Manager(FSDP2Config(mp_policy=None), mesh).parallelize(model)
        for name, p in model.named_parameters():
            assert p.placements[0] == Replicate(), name  # type: ignore[attr-defined]
            assert p.to_local().shape == p.shape, name  # type: ignore[attr-defined]


def test_moe_mesh_over_fewer_ranks_is_refused_by_the_dry_run() -> None:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        with pytest.raises(ValueError, match="moe_mesh spans 2 ranks.*device_mesh spans 4"):
            FSDP2Manager(FSDP2Config(), mesh, moe_mesh=mesh["dp"]).plan(small())


def test_moe_mesh_that_is_not_a_mesh_is_refused_by_the_dry_run() -> None:
    with fake_mesh((2,), ("dp",)) as mesh:
        with pytest.raises(TypeError, match="moe_mesh must be a torch DeviceMesh, got str"):
            FSDP2Manager(FSDP2Config(), mesh, moe_mesh="moe")  # type: ignore[arg-type]


def test_expert_modules_without_moe_mesh_logs_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with fake_mesh((2,), ("dp",)) as mesh, caplog.at_level(logging.WARNING, logger="fsdptx.manager"):
        FSDP2Manager(FSDP2Config(expert_modules=("layers.*.mlp",)), mesh)
    assert "expert_modules=('layers.*.mlp',) has no effect without a moe_mesh" in caplog.text


def test_mesh_without_this_rank_is_refused_before_any_change() -> None:
    model = small()
    before = state_of(model)
    with fake_mesh((4,), ("dp",)) as world:
        other = DeviceMesh(world.device_type, [2, 3], mesh_dim_names=("dp",))
        with pytest.raises(fsdptx.PlanMismatchError, match=r"spans ranks \[2, 3\] but this process is rank 0"):
            FSDP2Manager(FSDP2Config(), other).parallelize(model)
    assert_unchanged(before, state_of(model))


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the refusal is for hosts without an accelerator")
def test_pinned_cpu_offload_without_accelerator_is_refused_before_any_change() -> None:
    model = small()
    before = state_of(model)
    with fake_mesh((2,), ("dp",)) as mesh:
        with pytest.raises(fsdptx.PlanMismatchError, match=r"pin_memory=False"):
            FSDP2Manager(FSDP2Config(offload_policy=CPUOffloadPolicy()), mesh).parallelize(model)
    assert_unchanged(before, state_of(model))


def test_unpinned_cpu_offload_is_accepted() -> None:
    model = small()
    with fake_mesh((2,), ("dp",)) as mesh:
        FSDP2Manager(FSDP2Config(mp_policy=None, offload_policy=CPUOffloadPolicy(pin_memory=False)), mesh).parallelize(model)
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("bad", ["model", None], ids=["str", "None"])
def test_maybe_compile_names_the_argument_of_the_wrong_type(bad: object) -> None:
    with fake_mesh((2,), ("dp",)) as mesh:
        manager = FSDP2Manager(FSDP2Config(), mesh)
        with pytest.raises(TypeError, match="maybe_compile: model must be a torch.nn.Module"):
            manager.maybe_compile(bad)  # type: ignore[arg-type]


def test_async_tensor_parallel_switch_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not monkeypatch.setattr: undoing it on inductor's config module deletes the entry.
    saved = inductor_config._micro_pipeline_tp  # type: ignore[attr-defined]
    inductor_config._micro_pipeline_tp = False  # type: ignore[attr-defined]
    try:
        compiled: list[str] = []
        monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(type(self).__name__))
        with fake_mesh((1, 2), ("dp", "tp")) as mesh:
            manager = FSDP2Manager(FSDP2Config(sequence_parallel=True, enable_async_tensor_parallel=True), mesh)
            manager.maybe_compile(small())
            assert inductor_config._micro_pipeline_tp is True  # type: ignore[attr-defined]
            manager.restore_async_tensor_parallel()
        assert inductor_config._micro_pipeline_tp is False  # type: ignore[attr-defined]
        assert compiled == ["Block", "Block"]
    finally:
        inductor_config._micro_pipeline_tp = saved  # type: ignore[attr-defined]


def test_async_tensor_parallel_with_compile_leaves_no_compiler_setting_changed_once_restored() -> None:
    import torch._dynamo.config as dynamo_config

    inductor_before = inductor_config.get_config_copy()  # type: ignore[attr-defined]
    dynamo_before = dynamo_config.get_config_copy()  # type: ignore[attr-defined]
    model = small()
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        config = FSDP2Config(
            sequence_parallel=True, enable_async_tensor_parallel=True, enable_compile=True, mp_policy=None
        )
        manager = FSDP2Manager(config, mesh)
        manager.parallelize(model)
        manager.maybe_compile(model)
        manager.maybe_compile(model)  # twice: each call's switch is put back
        assert inductor_config._micro_pipeline_tp is True  # type: ignore[attr-defined]
        manager.restore_async_tensor_parallel()
    assert all(b._compiled_call_impl is not None for b in model.layers)
    changed = {k for k, v in inductor_config.get_config_copy().items() if inductor_before.get(k) != v}  # type: ignore[attr-defined]
    assert changed == set()
    assert dynamo_config.get_config_copy() == dynamo_before  # type: ignore[attr-defined]


def test_patch_is_packed_sequence_returns_false_without_the_function(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("transformers.modeling_flash_attention_utils")
    package = types.ModuleType("transformers")
    package.modeling_flash_attention_utils = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", package)
    monkeypatch.setitem(sys.modules, "transformers.modeling_flash_attention_utils", fake)
    assert fsdptx.patch_is_packed_sequence() is False
    assert not hasattr(fake, "_is_packed_sequence")


def test_defer_fsdp_grad_sync_is_the_default_of_the_managers_context(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsdptx.manager as manager_module

    seen: list[bool] = []

    def record(model: object, is_optimizer_step: bool, *, defer: bool = True) -> object:
        seen.append(defer)
        return functools.partial(lambda: None)

    monkeypatch.setattr(manager_module, "gradient_sync_context", record)
    with fake_mesh((2,), ("dp",)) as mesh:
        FSDP2Manager(FSDP2Config(defer_fsdp_grad_sync=False), mesh).gradient_sync_context(small(), False)
        FSDP2Manager(FSDP2Config(), mesh).gradient_sync_context(small(), False)
    assert seen == [False, True]


@pytest.mark.parametrize("path", ["layers.0", "layers.0.attn"])
def test_module_already_fully_sharded_by_the_user_is_refused_by_name(path: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = small()
    with fake_mesh((2,), ("dp",)) as mesh:
        fully_shard(model.get_submodule(path), mesh=mesh)
        before = state_of(model)
        with pytest.raises(fsdptx.PlanningError, match=f"'{path}' is already FSDP-sharded.*fully_shard_by_dtype"):
            FSDP2Manager(FSDP2Config(), mesh).parallelize(model)
        assert_unchanged(before, state_of(model))
