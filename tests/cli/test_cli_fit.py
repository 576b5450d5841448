"""``python -m fsdptx plan --fit GPUSxMEMORY``: what it lists fits, what it
leaves out does not, each with the config and mesh that reproduce it."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from fsdptx.cli._fit import meshes, parse_fit
from fsdptx.cli._main import main

# A small preset whose 8-GPU, 2 GiB search lists some configurations (16,
# some within 1% of the budget) and not others; with 4 blocks the search
# traces 2 and 3 and extrapolates, while a re-plan traces all 4. No
# headroom: the budget's edge is what these tests probe.
MODEL = ("--preset", "llama", "--layers", "4", "--seq", "4608")
BUDGET = 2 * 2**30


@pytest.fixture(scope="module")
def fit() -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *MODEL, "--fit", "8x2GiB", "--headroom", "0", "--json"]) == 0
    return json.loads(out.getvalue())["fit"]  # type: ignore[no-any-return]


def replanned_peak(capsys: pytest.CaptureFixture[str], candidate: dict[str, Any]) -> int:
    assert main(["plan", *MODEL, *candidate["argv"], "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    return int(data["memory"]["peak_bytes"])


def test_the_search_lists_at_least_one_configuration(fit: dict[str, Any]) -> None:
    assert fit["fitting"]
    assert fit["evaluated"] == len(fit["fitting"]) + len(fit["not_fitting"])


def test_every_listed_configuration_fits_when_replanned_with_its_printed_options(
    capsys: pytest.CaptureFixture[str], fit: dict[str, Any]
) -> None:
    over = {
        " ".join(c["argv"]): peak
        for c in fit["fitting"]
        if (peak := replanned_peak(capsys, c)) > BUDGET
    }
    assert not over, f"listed but over {BUDGET:,} B when re-planned: {over}"


def test_the_configuration_just_over_the_budget_is_not_listed(
    capsys: pytest.CaptureFixture[str], fit: dict[str, Any]
) -> None:
    closest = fit["not_fitting"][0]  # the smallest predicted peak that did not fit
    assert closest["peak_bytes"] > BUDGET
    assert replanned_peak(capsys, closest) > BUDGET
    assert closest["argv"] not in [c["argv"] for c in fit["fitting"]]


def test_listed_configurations_come_best_first_by_predicted_throughput(fit: dict[str, Any]) -> None:
    order = [c["predicted_step"]["tokens_per_s_per_gpu"] for c in fit["fitting"]]
    assert len(order) > 1 and order == sorted(order, reverse=True)


def test_each_listed_configuration_names_its_fsdp2_config(fit: dict[str, Any]) -> None:
    for c in fit["fitting"]:
        assert c["config"].startswith("FSDP2Config(")
        assert ("--offload" in c["argv"]) == ("CPUOffloadPolicy()" in c["config"])
        assert ("--ac" in c["argv"]) == ("activation_checkpointing=" in c["config"])


def test_meshes_of_a_world_multiply_to_it_and_keep_tp_within_a_node() -> None:
    found = meshes(64)
    for m in found:
        assert m.get("dp_replicate", 1) * m["dp_shard"] * m.get("tp", 1) == 64
        assert m.get("tp", 1) <= 8
    assert {"dp_shard": 8, "tp": 8} in found and {"dp_shard": 64} in found


def test_budgets_read_binary_and_decimal_units() -> None:
    assert parse_fit("64x80GiB") == (64, 80 * 2**30)
    assert parse_fit("8x40GB") == (8, 40 * 10**9)
    with pytest.raises(ValueError, match="expected GPUSxMEMORY"):
        parse_fit("eight GPUs")
