"""``python -m fsdptx plan --moe-mesh``: the dry run's per-rank bytes under
expert parallelism, on DeepSeek-V3 built from a small config."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from fsdptx.cli._main import main
from fsdptx.hf import build_hf_model

HF_CONFIG = {
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "head_dim": 8,
    "vocab_size": 256,
    "n_group": 1,
    "topk_group": 1,
}
ARGS = ("plan", "--hf", "deepseek_v3", "--hf-config", ",".join(f"{k}={v}" for k, v in HF_CONFIG.items()))


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([*ARGS, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_per_rank_bytes_are_experts_over_ep_times_shard_plus_dense_over_the_dense_shard(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _plan(capsys, "--mesh", "dp_replicate=2,dp_shard=2", "--moe-mesh", "dp_shard=2,ep=2", "--json")
    assert code == 0, err
    data = json.loads(out)
    model = build_hf_model("deepseek_v3", HF_CONFIG, dtype=torch.bfloat16, device="meta")
    params = dict(model.named_parameters())
    experts = {n for n in params if ".mlp.experts." in n}
    assert experts and data["plan"]["plan"]["expert_parallel"]["params"] == sorted(experts, key=list(params).index)
    expert_bytes = sum(params[n].numel() * params[n].element_size() for n in experts)
    dense_bytes = sum(p.numel() * p.element_size() for n, p in params.items() if n not in experts)
    want = expert_bytes / 4 + dense_bytes / 2
    # FSDP pads dim 0 to a multiple of the shard count: at most one row per parameter
    padding = sum(math.prod(p.shape[1:]) * p.element_size() for p in params.values())
    assert abs(data["bytes_per_rank"] - want) <= padding
    assert data["expert_bytes_per_rank"] == expert_bytes // 4  # 8 experts split evenly: no padding
    assert data["moe_mesh"] == {"mesh": {"dp_shard": 2, "ep": 2}, "ep": 2, "expert_fsdp_shard": 2}


def test_the_text_report_says_how_experts_are_split(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _plan(capsys, "--mesh", "dp=4", "--moe-mesh", "dp_shard=2,ep=2")
    assert code == 0, err
    assert "experts on the MoE mesh dp_shard=2, ep=2: split by expert across ep=2, then FSDP over 2 ranks" in out
    assert "model.layers.{1..2}.mlp.experts  Shard(0) on ep" in out
    assert "split over ep=2 x 2 shards" in out


@pytest.mark.parametrize(
    ("moe", "extra", "match"),
    [
        ("dp_shard=2,ep=3", (), "spans 6 ranks but --mesh spans 4"),
        ("dp_shard=2,expert=2", (), "unknown axis 'expert'"),
        ("dp_shard=1,ep=4", ("--hf-config", "n_routed_experts=6"), r"experts \(6 experts\).*cannot be split evenly across ep=4"),
    ],
    ids=["other-world", "unknown-axis", "ep-does-not-divide"],
)
def test_bad_moe_meshes_are_refused_with_one_line(
    capsys: pytest.CaptureFixture[str], moe: str, extra: tuple[str, ...], match: str
) -> None:
    code, _, err = _plan(capsys, "--mesh", "dp=4", "--moe-mesh", moe, *extra)
    assert code == 2 and len(err.splitlines()) == 1
    assert re.search(match, err), err


def test_fit_with_ep_counts_each_candidates_experts_as_plan_does(capsys: pytest.CaptureFixture[str]) -> None:
    """``--fit 4x... --ep 2``: the ``dp_shard=2 x tp=2`` candidate puts the
    experts on ``ep_shard=2 x ep=2`` (TP ranks folded in, so a rank holds a
    quarter of them); its parameters per rank are exactly what ``plan``
    reports for the candidate's own options, and no more than the same mesh
    without EP, where tensor parallelism splits each expert instead (also a
    quarter per rank)."""
    code, out, err = _plan(capsys, "--fit", "4x1GiB", "--ep", "2", "--seq", "16", "--json")
    assert code == 0, err
    fit = json.loads(out)["fit"]
    candidates = [c for c in fit["fitting"] + fit["not_fitting"] if c["mesh"] == {"dp_shard": 2, "tp": 2}]
    assert candidates and all(c["moe_mesh"] == {"ep_shard": 2, "ep": 2} for c in candidates)
    argv = next(c["argv"] for c in candidates if not c["offload"] and not c["activation_checkpointing"])
    assert argv == ["--mesh", "dp_shard=2,tp=2", "--moe-mesh", "ep_shard=2,ep=2", "--sp"]
    code, out, err = _plan(capsys, *argv, "--json")
    assert code == 0, err
    planned = json.loads(out)["memory"]["params_bytes"]
    assert {c["params_bytes"] for c in candidates if not c["offload"]} == {planned}
    code, out, err = _plan(capsys, "--mesh", "dp_shard=2,tp=2", "--sp", "--json")
    assert code == 0, err
    assert planned <= json.loads(out)["memory"]["params_bytes"]


def test_ep_without_fit_and_moe_mesh_with_fit_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _plan(capsys, "--mesh", "dp=4", "--ep", "2")
    assert code == 2 and "--ep applies to --fit" in err
    code, _, err = _plan(capsys, "--fit", "4x1GiB", "--moe-mesh", "dp_shard=2,ep=2")
    assert code == 2 and "use --ep N" in err


def _fit(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code, out, err = _plan(capsys, "--seq", "16", "--fit-pp", "1", "--json", *argv)
    assert code == 0, err
    return json.loads(out)["fit"]  # type: ignore[no-any-return]


def _eps(fit: dict[str, object]) -> set[int]:
    listed = [*fit["fitting"], *fit["not_fitting"]]  # type: ignore[misc]
    return {c["moe_mesh"]["ep"] if c["moe_mesh"] else 1 for c in listed}


def test_fit_tries_each_expert_parallel_size_that_divides_the_experts_by_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """8 experts on 4 GPUs: ep 1 (experts in their blocks), 2 and 4 (not 8:
    more ranks than the world); the same candidates as asking for those
    sizes, and each ep's candidates those of ``--ep N`` alone."""
    auto = _fit(capsys, "--fit", "4x1GiB")
    assert _eps(auto) == {1, 2, 4}
    assert not any("ep=8" in s for s in auto["skipped"])  # type: ignore[attr-defined]
    listed = _fit(capsys, "--fit", "4x1GiB", "--ep", "1,2,4")
    assert auto["fitting"] == listed["fitting"] and auto["not_fitting"] == listed["not_fitting"]
    only = _fit(capsys, "--fit", "4x1GiB", "--ep", "2")
    assert _eps(only) == {2}
    picked = [c for c in [*auto["fitting"], *auto["not_fitting"]] if c["moe_mesh"] and c["moe_mesh"]["ep"] == 2]
    assert sorted(map(json.dumps, picked)) == sorted(map(json.dumps, [*only["fitting"], *only["not_fitting"]]))


def test_fit_tries_no_expert_split_on_a_model_without_experts(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--preset", "llama", "--layers", "2", "--seq", "64", "--fit", "4x8GiB", "--fit-pp", "1", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    fit = json.loads(out)["fit"]
    assert fit["fitting"] and all(c["moe_mesh"] is None for c in [*fit["fitting"], *fit["not_fitting"]])


@pytest.mark.parametrize(
    ("ep", "says"),
    [("two", "malformed --ep 'two'"), ("0", "--ep '0': sizes must be integers >= 1")],
)
def test_bad_expert_parallel_sizes_are_refused_in_one_line(capsys: pytest.CaptureFixture[str], ep: str, says: str) -> None:
    code, out, err = _plan(capsys, "--fit", "4x1GiB", "--ep", ep)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert says in err, err


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_skipped_with_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fit = _fit(capsys, "--fit", "6x1GiB", "--ep", "1,3")
    assert _eps(fit) == {1}
    assert any("cannot be split evenly across ep=3" in s or "does not divide the expert count" in s for s in fit["skipped"]), fit["skipped"]
