"""The per-rank memory plan: figures computed from shapes equal what
``parallelize`` really allocates, and the peak estimate adds up as
:class:`fsdptx.cli._report.MemoryPlan` documents."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from fsdptx.cli import _run as _cli  # the dry run reads its apply budget there
from fsdptx.cli._common import param_shards
from fsdptx.cli._main import main
from fsdptx.plan._plan import Plan
from fsdptx.cli._report import OPTIMIZER_STATES, ParamShard, local_shape, memory_plan
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

# Dims chosen so dp=3 pads (12 and 20 are not multiples of 3) while tp=2 divides.
SMALL = DecoderConfig(vocab=50, dim=12, hidden=20, layers=3, fp32_holders=True, sibling_dtype=torch.bfloat16)
MESHES = [
    ((3,), ("dp",)),
    ((3, 2), ("dp", "tp")),
    ((2, 3), ("dp_replicate", "dp_shard")),
    ((2, 2, 2), ("dp_replicate", "dp_shard", "tp")),
]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main(["plan", *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


def small_decoder() -> Decoder:
    with torch.device("meta"):
        return Decoder(SMALL)


def applied_shards(shape: Sequence[int], names: Sequence[str], *, fsdp_applied: bool) -> dict[str, ParamShard]:
    model = small_decoder()
    with fake_mesh(shape, names) as mesh:
        manager = FSDP2Manager(FSDP2Config(sequence_parallel="tp" in names), mesh)
        p = manager.plan(model)
        manager.parallelize(model)
        return param_shards(model, p, manager.dims, fsdp_applied=fsdp_applied)


# --------------------------------------------------------------------------- computed == allocated


@pytest.mark.parametrize(("shape", "names"), MESHES, ids=[",".join(n) for _, n in MESHES])
def test_shards_computed_from_shapes_equal_the_dtensor_local_shards(shape: Sequence[int], names: Sequence[str]) -> None:
    read = applied_shards(shape, names, fsdp_applied=True)
    computed = applied_shards(shape, names, fsdp_applied=False)
    assert computed == read


def test_local_shape_rounds_up_like_torch_chunk() -> None:
    assert local_shape((10, 4), tp_dim=None, tp=1, shards=4) == (3, 4)
    assert local_shape((1, 4), tp_dim=None, tp=1, shards=8) == (1, 4)
    assert local_shape((8, 6), tp_dim=1, tp=4, shards=2) == (4, 2)
    assert local_shape((8, 6), tp_dim=0, tp=2, shards=3) == (2, 6)


def test_cli_figures_are_the_same_when_fsdp_is_computed_instead_of_applied(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ("--layers", "3", "--mesh", "dp=3,tp=2", "--sp")
    applied = run_json(capsys, *argv)
    monkeypatch.setattr(_cli, "APPLY_BUDGET", 100)  # enough for TP alone, not for fully_shard
    computed = run_json(capsys, *argv)
    assert (applied["applied"], computed["applied"]) == ("full", "tp")
    assert computed["memory"] == applied["memory"]
    assert computed["units"] == applied["units"]


def test_computed_fsdp_is_said_in_the_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cli, "APPLY_BUDGET", 0)
    assert main(["plan", "--preset", "llama", "--layers", "1"]) == 0
    out, _ = capsys.readouterr()
    assert "FSDP shards computed from shapes, not applied" in out


# --------------------------------------------------------------------------- the memory rows


def test_gradients_mirror_the_sharded_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    m = run_json(capsys, "--preset", "llama", "--layers", "1")["memory"]
    assert m["grads_bytes"] == m["params_bytes"]


@pytest.mark.parametrize("optimizer", list(OPTIMIZER_STATES))
def test_optimizer_state_is_its_states_per_sharded_element_in_the_parameters_dtype(
    capsys: pytest.CaptureFixture[str], optimizer: str
) -> None:
    """torch's optimizers make their state with ``zeros_like`` of each
    sharded parameter: fp32 master weights get fp32 states, bf16-stored
    weights bf16 ones (counting fp32 for those doubled the state)."""
    data = run_json(capsys, "--preset", "llama", "--layers", "1", "--optimizer", optimizer)
    local_elements = data["memory"]["params_bytes"] // 4  # llama stores fp32
    assert data["memory"]["optimizer_bytes"] == OPTIMIZER_STATES[optimizer] * 4 * local_elements
    tiny = "num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,vocab_size=256"
    data = run_json(capsys, "--hf", "llama", "--hf-config", tiny, "--dtype", "bf16", "--optimizer", optimizer)
    local_elements = data["memory"]["params_bytes"] // 2
    assert data["memory"]["optimizer_bytes"] == OPTIMIZER_STATES[optimizer] * 2 * local_elements


def test_adamw_is_the_default_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_json(capsys, "--preset", "llama", "--layers", "1")["memory"]["optimizer"] == "adamw"


def test_largest_gathered_unit_is_the_biggest_unsharded_unit_in_compute_dtype(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "2")
    root = next(u for u in data["units"] if u["modules"] == [""])
    assert data["memory"]["largest_gathered_unit"] == {"modules": [""], "bytes": root["numel"] * 2}


def test_peaks_are_steady_state_plus_the_gathered_units(capsys: pytest.CaptureFixture[str]) -> None:
    m = run_json(capsys, "--preset", "llama", "--layers", "4")["memory"]
    steady = m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]
    assert m["peak_forward_bytes"] == steady + m["peak_forward_gathered_bytes"]
    assert m["peak_backward_bytes"] == steady + m["peak_backward_gathered_bytes"]


def test_text_memory_rows_show_the_json_figures(capsys: pytest.CaptureFixture[str]) -> None:
    m = run_json(capsys, "--preset", "llama", "--layers", "2")["memory"]
    assert main(["plan", "--preset", "llama", "--layers", "2"]) == 0
    out, _ = capsys.readouterr()
    assert f"({m['params_bytes']:,} B = " in out
    rows = ("parameters", "gradients", "optimizer (adamw, 2 states in the parameters' dtype)", "largest all-gathered unit")
    for row in (*rows, "peak forward", "peak backward"):
        assert f"\n  {row}" in out, row


# --------------------------------------------------------------------------- the peak model (pure)


def llama_plan(layers: int, **config: Any) -> tuple[Plan, dict[str, ParamShard]]:
    """Plan a small llama-shaped decoder for dp=2 and its computed shards."""
    with torch.device("meta"):
        model = Decoder(DecoderConfig(vocab=64, dim=16, hidden=32, layers=layers))
    with fake_mesh((2,), ("dp",)) as mesh:
        manager = FSDP2Manager(FSDP2Config(**config), mesh)
        p = manager.plan(model)
        return p, param_shards(model, p, manager.dims, fsdp_applied=False)


def gathered(p: Plan, shards: dict[str, ParamShard], fqn: str) -> int:
    mem = memory_plan(p, shards, dp_shard=2)
    return next(m.gathered for u, m in zip(p.units, mem.units) if u.modules == (fqn,))


def test_forward_peak_holds_unresharded_units_plus_one_block_and_its_forward_prefetch() -> None:
    p, shards = llama_plan(4)
    mem = memory_plan(p, shards, dp_shard=2)
    block, root = gathered(p, shards, "layers.0"), gathered(p, shards, "")
    # root and layers.3 stay gathered; layers.0 runs while layers.1 is prefetched.
    assert mem.forward_gathered == root + block + 2 * block


def test_deeper_forward_prefetch_raises_the_forward_peak() -> None:
    p1, shards = llama_plan(6)
    p3, _ = llama_plan(6, fsdp2_forward_prefetch_depth=3)
    shallow = memory_plan(p1, shards, dp_shard=2).forward_gathered
    deep = memory_plan(p3, shards, dp_shard=2).forward_gathered
    assert deep - shallow == 2 * gathered(p1, shards, "layers.0")


def test_backward_peak_adds_the_backward_chain_and_one_reduce_scatter_input() -> None:
    p, shards = llama_plan(6)
    mem = memory_plan(p, shards, dp_shard=2)
    block, root = gathered(p, shards, "layers.0"), gathered(p, shards, "")
    fp32_block = 2 * block  # the reduce-scatter input: block gradients in fp32
    root_rs = 2 * root
    # Either a middle block (itself + 2 prefetched + its reduce buffer) or the root's reduction is worst.
    assert mem.backward_gathered == root + block + max(3 * block + fp32_block, root_rs)


def test_without_reshard_every_unit_stays_gathered() -> None:
    p, shards = llama_plan(4, reshard_after_forward=False)
    mem = memory_plan(p, shards, dp_shard=2)
    assert mem.forward_gathered == sum(m.gathered for m in mem.units)


def test_frozen_parameters_have_no_gradients_or_optimizer_state() -> None:
    p, shards = llama_plan(2)
    frozen = {k: dataclasses.replace(s, requires_grad=False) for k, s in shards.items()}
    mem = memory_plan(p, frozen, dp_shard=2)
    assert (mem.grads, mem.optimizer) == (0, 0)
    assert mem.params == memory_plan(p, shards, dp_shard=2).params


def test_unknown_optimizer_is_refused() -> None:
    p, shards = llama_plan(1)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        memory_plan(p, shards, dp_shard=2, optimizer="lion")


def test_params_no_unit_owns_count_in_full() -> None:
    _, shards = llama_plan(1)
    whole = {k: dataclasses.replace(s, local_numel=s.numel) for k, s in shards.items()}
    mem = memory_plan(Plan(), whole, dp_shard=2)
    assert mem.params == mem.params_ideal == sum(s.numel * 4 for s in whole.values())
    assert (mem.forward_gathered, mem.largest_unit) == (0, None)
