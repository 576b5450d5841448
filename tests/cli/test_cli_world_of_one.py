"""``python -m fsdptx plan`` on a world of one rank, and on GPT-OSS with
sequence parallelism: a report (text or valid JSON whose parts agree with
one another), or one line on stderr with exit 2; never a traceback."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fsdptx.cli._main import main
from fsdptx.plan._json import plan_from_document

LLAMA = ("--preset", "llama", "--layers", "2", "--mesh", "dp=1")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def report(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    data: dict[str, Any] = json.loads(out)
    return data


def _agrees_with_itself(data: dict[str, Any]) -> None:
    assert data["world_size"] == 1 and set(data["dims"].values()) == {1}
    plan = plan_from_document(data["plan"])
    assert [list(u.modules) for u in plan.units] == [u["modules"] for u in data["units"]]
    assert list(plan.warnings) == data["warnings"]
    assert sorted(i for row in data["rows"] for i in row["units"]) == [u["index"] for u in data["units"]]
    assert data["step"]["all_gathers"] == sum(u["all_gathers"] for u in data["units"])
    assert data["step"]["reduce_scatters"] == sum(u["reduce_scatters"] for u in data["units"])
    assert data["bytes_per_rank"] == data["model_bytes"]  # one rank holds everything


def test_json_on_a_world_of_one_with_a_policy_is_consistent_and_says_the_units_shard_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = report(capsys, *LLAMA)
    _agrees_with_itself(data)
    assert [u["modules"] for u in data["units"]] == [["layers.0"], ["layers.1"], [""]]
    assert any(w.startswith("a world of one rank: the FSDP units shard nothing") for w in data["warnings"])
    assert data["memory"]["peak_forward_at"] in {"layers.0", "layers.1", "<root>"}


def test_json_on_a_world_of_one_without_a_policy_has_no_units_and_no_peak_location(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = report(capsys, *LLAMA, "--mp", "none")
    _agrees_with_itself(data)
    assert (data["units"], data["rows"], data["warnings"], data["applied"]) == ([], [], [], "none")
    memory = data["memory"]
    assert memory["largest_gathered_unit"] is None
    assert memory["peak_forward_at"] is None and memory["peak_backward_at"] is None


def test_json_on_a_world_of_one_traces_a_step(capsys: pytest.CaptureFixture[str]) -> None:
    memory = report(capsys, *LLAMA, "--batch", "1", "--seq", "16")["memory"]
    assert memory["activations_bytes"] > 0 and memory["peak_bytes"] >= memory["params_bytes"]


def test_a_trace_of_a_plan_without_units_is_one_line_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *LLAMA, "--mp", "none", "--batch", "1", "--seq", "16")
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith("fsdptx: error: the activation trace follows FSDP's units, and this plan has none")
    assert "--mp fp32" in line


def test_the_text_report_on_a_world_of_one_says_the_units_apply_the_policy(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *LLAMA)
    assert (code, err) == (0, "")
    assert out.startswith("warning: a world of one rank")
    assert "one data-parallel rank: the FSDP units shard nothing, they apply the policy" in out


@pytest.mark.parametrize("extra", [(), ("--json",), ("--ac", "selective", "--loss-parallel")], ids=["text", "json", "ac-loss-parallel"])
def test_gpt_oss_with_sequence_parallelism_is_a_plan_or_one_line(
    capsys: pytest.CaptureFixture[str], extra: tuple[str, ...]
) -> None:
    pytest.importorskip("transformers")
    code, out, err = run(capsys, "--hf", "gpt_oss", "--mesh", "dp=2,tp=2", "--sp", *extra)
    if code == 2:
        assert out == "" and len(err.splitlines()) == 1 and err.startswith("fsdptx: error: ")
        return
    assert code == 0 and err == ""
    if "--json" in extra:
        data = json.loads(out)
        assert data["dims"]["tp"] == 2 and plan_from_document(data["plan"]).tensor_parallel is not None
    else:
        assert "tensor parallel with sequence parallelism" in out
