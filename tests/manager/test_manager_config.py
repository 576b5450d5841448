"""``FSDP2Config`` validates at construction, naming the field.

A launcher typo (a negative prefetch depth, ``"ful"`` checkpointing, async
TP without SP) must fail where the config is built, before any process group
is created, and the message must say which field is wrong.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from fsdptx import FSDP2Config, FSDP2Manager
from fsdptx.testing import fake_mesh


@pytest.mark.parametrize("field", ["fsdp2_backward_prefetch_depth", "fsdp2_forward_prefetch_depth"])
@pytest.mark.parametrize("value", [-1, 1.0, True, "2", None])
def test_prefetch_depth_must_be_a_non_negative_int(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"FSDP2Config.{field}"):
        FSDP2Config(**{field: value})


@pytest.mark.parametrize("field", ["fsdp2_backward_prefetch_depth", "fsdp2_forward_prefetch_depth"])
def test_prefetch_depth_zero_is_allowed(field: str) -> None:
    assert getattr(FSDP2Config(**{field: 0}), field) == 0


@pytest.mark.parametrize("value", ["ful", "Full", "none", 1, None])
def test_unknown_checkpointing_mode_is_rejected(value: object) -> None:
    with pytest.raises(ValueError, match="FSDP2Config.activation_checkpointing"):
        FSDP2Config(activation_checkpointing=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "mode"), [(False, None), (True, "full"), ("full", "full"), ("selective", "selective")]
)
def test_checkpointing_setting_resolves_to_a_mode(value: object, mode: str | None) -> None:
    assert FSDP2Config(activation_checkpointing=value).checkpoint_mode == mode  # type: ignore[arg-type]


def test_async_tensor_parallel_without_sequence_parallel_is_rejected() -> None:
    with pytest.raises(ValueError, match="FSDP2Config.enable_async_tensor_parallel"):
        FSDP2Config(enable_async_tensor_parallel=True)


def test_async_tensor_parallel_with_sequence_parallel_is_accepted() -> None:
    assert FSDP2Config(enable_async_tensor_parallel=True, sequence_parallel=True).enable_async_tensor_parallel


@pytest.mark.parametrize(
    "field",
    [
        "sequence_parallel",
        "patch_is_packed_sequence",
        "defer_fsdp_grad_sync",
        "enable_async_tensor_parallel",
        "enable_compile",
        "enable_fsdp2_prefetch",
    ],
)
def test_flags_must_be_bools(field: str) -> None:
    with pytest.raises(TypeError, match=f"FSDP2Config.{field}"):
        FSDP2Config(**{field: "yes"})


_WRONG_TYPES: dict[str, tuple[str, object, type[Exception]]] = {
    "mp_policy-string": ("mp_policy", "bf16", TypeError),
    "mp_policy-dtype": ("mp_policy", torch.bfloat16, TypeError),
    "offload_policy-bool": ("offload_policy", True, TypeError),
    "tp_plan-list": ("tp_plan", [("lm_head", "colwise")], TypeError),
    "expert_modules-int": ("expert_modules", 3, TypeError),
    "blocks-int-entry": ("blocks", ("layers.*", 3), TypeError),
    "reshard-zero": ("reshard_after_forward", 0, ValueError),
    "reshard-string": ("reshard_after_forward", "yes", ValueError),
}


@pytest.mark.parametrize("case", list(_WRONG_TYPES))
def test_wrong_types_are_rejected_naming_the_field(case: str) -> None:
    field, value, error = _WRONG_TYPES[case]
    with pytest.raises(error, match=f"FSDP2Config.{field}"):
        FSDP2Config(**{field: value})


class _Wrong:
    """A value no field takes."""

    def __repr__(self) -> str:
        return "<wrong>"


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(FSDP2Config)])
def test_every_field_refuses_a_value_of_the_wrong_type_naming_the_field(field: str) -> None:
    with pytest.raises((TypeError, ValueError), match=rf"^FSDP2Config\.{field}\b"):
        FSDP2Config(**{field: _Wrong()})


_SCALARS = [f.name for f in dataclasses.fields(FSDP2Config) if type(f.default) in (bool, int)]


@pytest.mark.parametrize("field", _SCALARS)
@pytest.mark.parametrize("text", ["True", "1", ""])
def test_a_string_where_a_bool_or_int_belongs_is_refused_naming_the_field(field: str, text: str) -> None:
    with pytest.raises((TypeError, ValueError), match=rf"^FSDP2Config\.{field}\b"):
        FSDP2Config(**{field: text})


@pytest.mark.parametrize("field", ["expert_modules", "cross_block_modules", "blocks"])
@pytest.mark.parametrize("value", [True, 1, 2.0, ("layers.*", False)], ids=["bool", "int", "float", "bool-entry"])
def test_name_fields_refuse_a_bool_or_number_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=rf"^FSDP2Config\.{field} must"):
        FSDP2Config(**{field: value})


@pytest.mark.parametrize("field", ["expert_modules", "cross_block_modules", "blocks"])
@pytest.mark.parametrize("value", ["", ("layers.*", "")], ids=["bare", "entry"])
def test_name_fields_refuse_an_empty_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^FSDP2Config\.{field} holds an empty name"):
        FSDP2Config(**{field: value})


@pytest.mark.parametrize("field", ["expert_modules", "cross_block_modules", "blocks"])
def test_a_bare_string_of_names_is_one_name_stored_as_a_tuple(field: str) -> None:
    # fsdptx's one rule for names: a bare string is one name, never its letters.
    assert getattr(FSDP2Config(**{field: "layers.*"}), field) == ("layers.*",)
    assert getattr(FSDP2Config(**{field: ["layers.*"]}), field) == ("layers.*",)


def test_defaults_are_the_reference_ones() -> None:
    cfg = FSDP2Config()
    assert cfg.mp_policy == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16, cast_forward_inputs=True
    )
    assert (cfg.fsdp2_forward_prefetch_depth, cfg.fsdp2_backward_prefetch_depth) == (1, 2)
    assert (cfg.activation_checkpointing, cfg.sequence_parallel, cfg.defer_fsdp_grad_sync) == (False, False, True)


def test_mp_policy_none_means_mixed_precision_disabled() -> None:
    assert FSDP2Config(mp_policy=None).mp_policy is None


def test_valid_settings_are_kept() -> None:
    settings: dict[str, Any] = {
        "offload_policy": CPUOffloadPolicy(),
        "reshard_after_forward": 2,
        "tp_plan": {"lm_head": "colwise_rep"},
        "expert_modules": ("layers.*.experts",),
    }
    cfg = FSDP2Config(**settings)
    assert {k: getattr(cfg, k) for k in settings} == settings


def test_config_is_immutable() -> None:
    cfg = FSDP2Config()
    with pytest.raises(AttributeError):
        cfg.sequence_parallel = True  # type: ignore[misc]


def test_manager_rejects_a_config_that_is_not_an_fsdp2_config() -> None:
    with fake_mesh((2,), ("dp",)) as mesh, pytest.raises(TypeError, match="FSDP2Config"):
        FSDP2Manager({"sequence_parallel": True}, mesh)  # type: ignore[arg-type]


def test_manager_rejects_a_mesh_with_an_unknown_dim_name() -> None:
    with fake_mesh((2, 2), ("dp", "foo")) as mesh, pytest.raises(ValueError, match="'foo'"):
        FSDP2Manager(FSDP2Config(), mesh)


def test_manager_exposes_the_reference_attributes() -> None:
    cfg = FSDP2Config(sequence_parallel=True, activation_checkpointing="selective", fsdp2_forward_prefetch_depth=3)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        manager = FSDP2Manager(cfg, mesh)
    assert (manager.sequence_parallel, manager.activation_checkpointing, manager.fsdp2_forward_prefetch_depth) == (
        True,
        "selective",
        3,
    )


def test_cross_block_modules_must_be_names() -> None:
    with pytest.raises(TypeError, match="cross_block_modules"):
        FSDP2Config(cross_block_modules=3)  # type: ignore[arg-type]
