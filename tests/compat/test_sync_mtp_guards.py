"""MTP guards raise the reference's exception types.

Callers of the reference catch ``RuntimeError`` (MTP + CP) and
``NotImplementedError`` (MTP + CP + PP); earlier fsdptx raised ``ValueError``
for both, so the errors are both, and these tests pin the reference types.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

import fsdptx


class _Model(nn.Module):
    def __init__(self, stage: bool | None = None, **flags: bool) -> None:
        super().__init__()
        self.supports = SimpleNamespace(**flags)
        self._stage = stage

    def _is_pipeline_parallel_stage(self) -> bool:
        if self._stage is None:
            raise AssertionError("the hook must not matter here")
        return self._stage


def test_mtp_cp_raises_runtime_error_saying_what_is_unsupported() -> None:
    with pytest.raises(RuntimeError, match="does not support MTP with context parallelism"):
        fsdptx.reject_unsupported_mtp_cp(_Model(mtp_enabled=True, supports_mtp_cp=False))


def test_mtp_cp_error_is_still_a_value_error_for_earlier_callers() -> None:
    with pytest.raises(ValueError):
        fsdptx.reject_unsupported_mtp_cp(_Model(mtp_enabled=True))


def test_mtp_cp_pp_raises_not_implemented_error_with_pp_size() -> None:
    model = _Model(mtp_enabled=True, supports_mtp_cp=True, supports_mtp_cp_pp=False)
    with pytest.raises(NotImplementedError, match="pp_size=2"):
        fsdptx.reject_unsupported_mtp_cp_pp(model, pp_size=2)


def test_mtp_cp_pp_without_cp_support_raises_runtime_error_not_not_implemented() -> None:
    model = _Model(mtp_enabled=True, supports_mtp_cp=False, supports_mtp_cp_pp=True)
    with pytest.raises(RuntimeError) as info:
        fsdptx.reject_unsupported_mtp_cp_pp(model, pp_size=2)
    assert not isinstance(info.value, NotImplementedError)


def test_mtp_cp_pp_detects_trimmed_stage_through_the_legacy_hook() -> None:
    model = _Model(stage=True, mtp_enabled=True, supports_mtp_cp=True, supports_mtp_cp_pp=False)
    with pytest.raises(NotImplementedError, match="trimmed pipeline stage"):
        fsdptx.reject_unsupported_mtp_cp_pp(model)


def test_mtp_cp_pp_hook_saying_no_stage_means_no_pipeline() -> None:
    model = _Model(stage=False, mtp_enabled=True, supports_mtp_cp=True, supports_mtp_cp_pp=False)
    fsdptx.reject_unsupported_mtp_cp_pp(model)


def test_mtp_cp_pp_hook_is_harmless_when_the_model_supports_it() -> None:
    model = _Model(stage=True, mtp_enabled=True, supports_mtp_cp=True, supports_mtp_cp_pp=True)
    fsdptx.reject_unsupported_mtp_cp_pp(model)
