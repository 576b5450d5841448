"""``plan --fit`` ranks what fits by the throughput of a predicted step
under a stated hardware model: host copies cost PCIe time, so offload ranks below the same
configuration without it; ``--headroom`` leaves memory out of the budget;
``--flops`` and the other figures override a ``--gpu`` preset; bad hardware
figures are refused in one line before anything is built."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from fsdptx.cli import _fit, _run
from fsdptx.cli._hardware import GPUS, link_of
from fsdptx.cli._main import main

# Small enough to search in seconds; at 80 GiB every configuration fits,
# with and without offload.
MODEL = ("plan", "--preset", "llama", "--layers", "2", "--seq", "256")


def _search(*argv: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*MODEL, *argv, "--json"])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())["fit"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def roomy() -> dict[str, Any]:
    return _search("--fit", "8x80GiB", "--headroom", "0")


@pytest.fixture(scope="module")
def tight(roomy: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A budget some candidate just fits without headroom, and a search at
    it with 10% headroom on an H100 of half the FLOP/s."""
    peaks = sorted(c["peak_bytes"] for c in roomy["fitting"])
    budget = next(p for p in peaks if peaks[0] <= 0.9 * p)
    return budget, _search("--fit", f"8x{budget}B", "--headroom", "10%", "--gpu", "h100", "--flops", "494.5")


def _key(c: dict[str, Any]) -> tuple[str, ...]:
    return tuple(c["argv"])


def test_offload_ranks_below_the_same_configuration_without_it(roomy: dict[str, Any]) -> None:
    order = [_key(c) for c in roomy["fitting"]]
    offloaded = [k for k in order if "--offload" in k]
    assert offloaded and len(offloaded) * 2 == len(order)  # everything fits both ways
    for k in offloaded:
        without = tuple(a for a in k if a != "--offload")
        assert order.index(without) < order.index(k), k
    assert "--offload" not in order[0]


def test_every_candidate_carries_its_predicted_breakdown(roomy: dict[str, Any]) -> None:
    assert roomy["hardware"]["name"] == "h100" and roomy["hardware"]["mfu"] == 0.4
    assert "FSDP/HSDP collectives overlap compute" in roomy["time_model"]
    for c in roomy["fitting"] + roomy["not_fitting"]:
        t = c["predicted_step"]
        assert t["compute_ms"] > 0
        assert t["total_ms"] == pytest.approx(max(t["compute_ms"], t["dp_comm_ms"]) + t["tp_comm_ms"] + t["offload_ms"])
        assert (t["offload_ms"] > 0) == c["offload"]
        assert t["tokens_per_gpu"] == 256 / c["mesh"].get("tp", 1)  # batch 1 x seq 256 per TP group
        assert t["tokens_per_s_per_gpu"] == pytest.approx(t["tokens_per_gpu"] / (t["total_ms"] / 1e3))
        assert ("tp" in t["links"]) == (c["mesh"].get("tp", 1) > 1)
        assert set(t["links"].values()) <= {"nvlink"}  # 8 GPUs: one node


def test_headroom_leaves_out_what_fits_only_within_it(
    roomy: dict[str, Any], tight: tuple[int, dict[str, Any]]
) -> None:
    budget, fit = tight
    assert fit["headroom_bytes"] == budget // 10 and fit["usable_bytes"] == budget - budget // 10
    within_budget = {_key(c) for c in roomy["fitting"] if c["peak_bytes"] <= budget}
    within_usable = {_key(c) for c in roomy["fitting"] if c["peak_bytes"] <= fit["usable_bytes"]}
    listed = {_key(c) for c in fit["fitting"]}
    assert listed == within_usable and listed < within_budget
    for c in fit["not_fitting"]:
        assert "over the usable" in c["rejected_because"]


def test_explicit_flops_override_the_presets(roomy: dict[str, Any], tight: tuple[int, dict[str, Any]]) -> None:
    _, fit = tight
    assert fit["hardware"]["flops_per_s"] == 494.5e12
    assert fit["hardware"]["nvlink_bytes_per_s"] == GPUS["h100"].nvlink  # the rest stays the preset's
    compute = {_key(c): c["predicted_step"]["compute_ms"] for c in roomy["fitting"]}
    assert fit["fitting"]
    for c in fit["fitting"]:
        assert c["predicted_step"]["compute_ms"] == pytest.approx(2 * compute[_key(c)])


def test_the_text_states_the_hardware_headroom_and_that_it_is_a_ranking_aid(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main([*MODEL, "--layers", "1", "--fit", "8x80GiB", "--top", "2", "--gpu", "a100", "--mfu", "0.5"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "a ranking aid and not a measurement" in out
    assert "a100: 312 TFLOP/s dense bf16 x mfu 0.5, NVLink 300 GB/s, network 25 GB/s per GPU, PCIe 32 GB/s" in out
    assert "--headroom 10% = 8.00 GiB" in out
    assert "  2. --mesh" in out and "  3. --mesh" not in out and "more fit (--top 2" in out
    assert "compute " in out and "TP comm " in out and "DP comm " in out and "offload " in out


@pytest.fixture
def nothing_built(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the refusal came after work began")

    monkeypatch.setattr(_run, "build_model", fail)
    monkeypatch.setattr(_fit, "meshes", fail)


@pytest.mark.usefixtures("nothing_built")
@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--gpu", "h1000"], "unknown --gpu 'h1000'; known: a100, b200, h100, h200"),
        (["--flops", "0"], "flops must be a positive number"),
        (["--network", "-5"], "network must be a positive number"),
        (["--mfu", "1.5"], "mfu must be in (0, 1]"),
        (["--gpus-per-node", "0"], "gpus_per_node must be an integer >= 1"),
        (["--headroom", "80GiB"], "leaves nothing"),
        (["--headroom", "ten"], "malformed --headroom 'ten'"),
        (["--top", "0"], "--top must be >= 1"),
    ],
)
def test_bad_hardware_figures_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    code = main([*MODEL, "--fit", "8x80GiB", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and said in err, err


@pytest.mark.usefixtures("nothing_built")
def test_time_model_options_without_fit_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*MODEL, "--gpu", "h100", "--headroom", "5%"])
    _, err = capsys.readouterr()
    assert code == 2 and "--headroom, --gpu apply to --fit" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("mesh", "per_node", "links"),
    [
        ({"dp_shard": 32, "tp": 8}, 8, {"tp": "nvlink", "dp_shard": "network"}),
        ({"dp_shard": 2, "tp": 4}, 8, {"tp": "nvlink", "dp_shard": "nvlink"}),
        ({"dp_replicate": 4, "dp_shard": 2, "tp": 4}, 8, {"tp": "nvlink", "dp_shard": "nvlink", "dp_replicate": "network"}),
        ({"dp_shard": 4, "tp": 8}, 4, {"tp": "network", "dp_shard": "network"}),
        ({"dp_shard": 3, "tp": 2}, 8, {"tp": "nvlink", "dp_shard": "nvlink"}),  # the whole world in one node
        ({"dp_shard": 6, "tp": 2}, 8, {"tp": "nvlink", "dp_shard": "network"}),  # groups straddle nodes
    ],
)
def test_a_dims_collectives_cross_the_network_once_its_groups_leave_a_node(
    mesh: dict[str, int], per_node: int, links: dict[str, str]
) -> None:
    assert {dim: link_of(mesh, dim, per_node) for dim in links} == links


def test_fsdp_traffic_per_rank_is_of_the_ranks_tp_shard(roomy: dict[str, Any]) -> None:
    """FSDP gathers and reduces each rank's TP shard: at the same shard
    count, tp=2 moves half of what tp=1 does (all but the replicated norms)."""
    by_mesh = {json.dumps(c["mesh"]): c["comm_bytes"] for c in roomy["fitting"] if not c["offload"]}
    tp1 = by_mesh[json.dumps({"dp_replicate": 2, "dp_shard": 4})]
    tp2 = by_mesh[json.dumps({"dp_shard": 4, "tp": 2})]
    for kind in ("fsdp_all_gather", "fsdp_reduce_scatter"):
        assert tp2[kind] == pytest.approx(tp1[kind] / 2, rel=0.01), kind
