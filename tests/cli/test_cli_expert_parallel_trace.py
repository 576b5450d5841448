"""A traced step under expert parallelism: ``python -m fsdptx plan
--moe-mesh ...,ep=2 --batch/--seq`` and ``estimate_memory`` trace the
step with the experts' token dispatch at sizes fixed by the routing
assumption (balanced, or ``--routing-skew F``), and say so."""

from __future__ import annotations

import json
import math
import re

import pytest
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx.cli import _main
from fsdptx.cli._main import main
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.testing import fake_mesh

import hf_zoo

BATCH, SEQ, TOP_K, EXPERTS, EP = 2, 64, 2, 8, 2
HF_CONFIG = {
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
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
ARGS = (
    "plan", "--hf", "deepseek_v3", "--hf-config", ",".join(f"{k}={v}" for k, v in HF_CONFIG.items()),
    "--mesh", "dp_shard=4", "--moe-mesh", f"ep_shard=2,ep={EP}",
)
TRACE = ("--batch", str(BATCH), "--seq", str(SEQ))


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code = main([*ARGS, *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data: dict[str, object] = json.loads(out)
    return data


def test_balanced_routing_gives_each_local_expert_the_mean_tokens_and_the_json_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    memory = _json(capsys, *TRACE)["memory"]
    assert isinstance(memory, dict)
    tokens = BATCH * SEQ  # tokens entering the experts module on each EP rank
    mean = EP * tokens * TOP_K // EXPERTS  # every EP rank sends its pairs: 64 per expert
    assert memory["expert_parallel"] == {
        "routing": "balanced",
        "routing_skew": 1.0,
        "ep": EP,
        "tokens_per_rank": tokens,
        "top_k": TOP_K,
        "num_experts": EXPERTS,
        "local_experts": EXPERTS // EP,
        "tokens_per_expert": mean,
        "send_rows": tokens * TOP_K,
        "recv_rows": EXPERTS // EP * mean,  # balanced: as many rows in as out
        "capped": False,
        "expert_modules": 1,
    }
    assert any(n.startswith("expert routing: assumed, not traced (balanced") for n in memory["estimated"])
    # the dispatch's exchanges ran on the ep group, forward and backward: 4 x 256 rows x 64 x bf16
    assert memory["collective_bytes"]["ep/all_to_all"] == 4 * tokens * TOP_K * HF_CONFIG["hidden_size"] * 2


def test_activations_grow_with_the_routing_skew(capsys: pytest.CaptureFixture[str]) -> None:
    figures = []
    for skew in ("1", "1.5", "3"):
        memory = _json(capsys, *TRACE, "--routing-skew", skew)["memory"]
        assert isinstance(memory, dict)
        routing = memory["expert_parallel"]
        mean = EP * BATCH * SEQ * TOP_K / EXPERTS
        assert routing["tokens_per_expert"] == math.ceil(float(skew) * mean)
        assert routing["routing"] == ("balanced" if skew == "1" else "skewed")
        figures.append((memory["activations_bytes"], memory["peak_bytes"]))
    activations = [a for a, _ in figures]
    assert activations[0] < activations[1] < activations[2], figures
    assert figures[0][1] <= figures[1][1] <= figures[2][1], figures


def test_the_experts_sharded_bytes_equal_the_untraced_plans(capsys: pytest.CaptureFixture[str]) -> None:
    untraced = _json(capsys)
    traced = _json(capsys, *TRACE, "--routing-skew", "2")
    assert traced["expert_bytes_per_rank"] == untraced["expert_bytes_per_rank"] > 0
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert traced["memory"][key] == untraced["memory"][key], key  # type: ignore[index]


def test_the_text_report_states_the_assumption(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*ARGS, *TRACE, "--routing-skew", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "expert parallel  ep=2, routing skew 2 (assumed): 128 tokens per local expert x 4 local experts" in out
    assert "estimated        expert routing: assumed, not traced (skew 2: the busiest expert receives 2 x the mean" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--routing-skew", "0.5"), "--routing-skew must be a number >= 1"),
        (("--routing-skew", "many"), "--routing-skew must be a number >= 1 .* got 'many'"),
        (("--routing-skew", "nan"), "--routing-skew must be a number >= 1"),
        (("--routing-skew", "2", "--moe-mesh", "ep_shard=4"), "needs an ep axis > 1 in --moe-mesh and --batch/--seq"),
    ],
    ids=["below-one", "not-a-number", "nan", "without-ep"],
)
def test_a_bad_routing_skew_is_refused_with_one_line_before_building(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...], message: str
) -> None:
    def never(*_: object) -> object:
        raise AssertionError("the model was built before --routing-skew was checked")

    monkeypatch.setattr(_main, "build_model", never)
    code = main([*ARGS, *TRACE, *argv])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert re.search(message, err), err


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_estimate_memory_traces_each_hf_experts_layout_under_ep(name: str) -> None:
    """The static dispatch runs each model's own experts layout (GPT-OSS:
    transposed weights, biases, its own gate) and the skew adds activations."""
    activations = []
    for skew in (1.0, 2.0):
        with fake_mesh((4,), ("dp_shard",)) as mesh:
            moe = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep_shard", "ep"))
            model = getattr(hf_zoo, name)()
            estimate = fsdptx.estimate_memory(
                FSDP2Manager(FSDP2Config(), mesh, moe), model, batch=1, seq=32, routing_skew=skew
            )
        routing = estimate.expert_routing
        assert routing is not None and routing.skew == skew
        experts = sum(1 for n, m in model.named_modules() if n.endswith("mlp.experts"))
        assert routing.modules == experts > 0
        mean = EP * 32 * routing.top_k / routing.num_experts
        assert routing.tokens_per_expert == min(math.ceil(skew * mean), EP * 32)
        assert estimate.to_json()["expert_parallel"]["routing_skew"] == skew
        activations.append(estimate.activations_bytes)
    assert activations[0] < activations[1]


def test_estimate_memory_balanced_by_default_says_what_it_assumed() -> None:
    with fake_mesh((4,), ("dp_shard",)) as mesh:
        moe = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep_shard", "ep"))
        estimate = fsdptx.estimate_memory(FSDP2Manager(FSDP2Config(), mesh, moe), hf_zoo.qwen3_moe(), batch=1, seq=32)
    assert estimate.expert_routing is not None and estimate.expert_routing.assumption == "balanced"
    assert any("expert routing: assumed, not traced (balanced" in n for n in estimate.notes)
