"""``fsdptx.caches``: one switch for every cache, and ``fsdptx.clear_caches``.

With caches off, every result comes from the plain function a cache sits
on (the property tests compare the two on generated models); these tests
pin down the switch itself, through what a Plan shows: a Plan made with
caches on is vouched for (``Plan.verified``), one made with them off is not.

``BoundedMemo``, the bounded least-recently-used structure every
process-wide memo is built on, is tested here directly.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdptx
from fsdptx.core._caches import BoundedMemo
from fsdptx.testing import mark_sharded
from fsdptx.presets import Decoder, DecoderConfig

BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _model() -> nn.Module:
    with torch.device("meta"):
        return Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=3, fp32_holders=True))


def _vouched() -> bool:
    """Whether planning, here and now, vouches for its Plan: it does only
    with caches on."""
    return fsdptx.plan(_model(), fsdptx.shard_by_dtype, mp_policy=BF16_POLICY).verified is not None


def test_caches_are_on_by_default() -> None:
    assert _vouched()


def test_caches_are_off_inside_the_block_and_on_again_after() -> None:
    with fsdptx.caches(enabled=False):
        assert not _vouched()
    assert _vouched()


def test_the_switch_is_restored_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), fsdptx.caches(enabled=False):
        raise RuntimeError("boom")
    assert _vouched()


def test_an_inner_block_turns_caches_on_for_itself_alone() -> None:
    with fsdptx.caches(enabled=False):
        with fsdptx.caches(enabled=True):
            assert _vouched()
        assert not _vouched()


def test_the_switch_holds_in_its_own_thread_only() -> None:
    seen: list[bool] = []
    with fsdptx.caches(enabled=False):
        worker = threading.Thread(target=lambda: seen.append(_vouched()))
        worker.start()
        worker.join()
    assert seen == [True]


def test_enabled_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="caches: enabled must be True or False, got 'no'"):
        with fsdptx.caches(enabled="no"):  # type: ignore[arg-type]
            pass


def test_a_plan_made_with_caches_off_applies_as_one_made_with_them_on() -> None:
    model = _model()
    on = fsdptx.plan(model, fsdptx.shard_by_dtype, mp_policy=BF16_POLICY)
    with fsdptx.caches(enabled=False):
        off = fsdptx.plan(model, fsdptx.shard_by_dtype, mp_policy=BF16_POLICY)
    assert on == off and on.verified is not None and off.verified is None
    assert fsdptx.check_plan(off, model) == fsdptx.check_plan(on, model)


def test_imperative_calls_after_clearing_the_caches_shard_as_before() -> None:
    def shard(model: nn.Module) -> list[str]:
        for block in model.layers:
            fsdptx.fully_shard_by_dtype(block, None, BF16_POLICY, None, shard_module=mark_sharded)  # type: ignore[arg-type]
        return [f for f, m in model.named_modules() if type(m).__name__.startswith("FSDP")]

    before = shard(_model())
    fsdptx.clear_caches()
    assert shard(_model()) == before


# --------------------------------------------------------------------------- BoundedMemo


def test_a_bounded_memo_keeps_the_most_recently_used_entries() -> None:
    memo: BoundedMemo[tuple[str], object] = BoundedMemo(limit=2)
    entry = object()
    memo.put(("a",), entry)
    memo.put(("b",), entry)
    assert memo.get(("a",)) is entry  # a hit counts as a use
    memo.put(("c",), entry)
    assert memo.get(("b",)) is None
    assert memo.get(("a",)) is entry and memo.get(("c",)) is entry
    assert len(memo) == 2


def test_a_bounded_memo_serves_lookups_and_stores_from_several_threads() -> None:
    """Lookups reorder the entries and stores evict them: from several
    threads at once, neither may fail the other. Threads switch every
    microsecond here, so a lookup meets an eviction within the run."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    memo: BoundedMemo[tuple[int], object] = BoundedMemo(limit=1)  # every store evicts what a lookup just found
    entry = object()
    errors: list[BaseException] = []

    def hammer(offset: int) -> None:
        try:
            for i in range(3000):
                memo.put((offset + i % 2,), entry)
                memo.get((offset + i % 2,))
        except BaseException as e:  # noqa: BLE001 (any failure fails the test)
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(previous)
    assert errors == [] and len(memo) <= 1
