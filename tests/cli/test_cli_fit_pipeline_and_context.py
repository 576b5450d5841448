"""``--fit`` across context and pipeline parallelism: ``cp`` candidates are
the traced step ``plan`` gives with their own options; ``pp`` candidates
(with or without ``cp``, interleaved or not) are modelled from the traced
blocks and stay within -10%/+15% of the step ``plan`` traces per stage
(interleaved ones: of a tracker run of each rank's stages in torch's
order), the sizing targets' band, with the same stage peaking; what cannot be
searched is listed with why."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from fsdptx import FSDP2Config, PipelineParallelConfig
from fsdptx.cli._fit_dims import most_held
from fsdptx.cli._main import main
from fsdptx.plan._stages import interleaved_1f1b_actions
from rank_tracker_recipe import rank_tracker_peak

MODEL = ("--preset", "llama", "--layers", "4", "--batch", "4", "--seq", "512")
LONG = ("--preset", "llama", "--layers", "4", "--batch", "4", "--seq", "2048")  # activations about half the peak
SEARCH = ("--fit", "8x8GiB", "--fit-cp", "2", "--fit-pp", "2,4", "--json")


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _json(argv: list[str]) -> dict[str, Any]:
    code, out, err = _run(argv)
    assert code == 0, err
    return json.loads(out)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def fit() -> dict[str, Any]:
    return _json(["plan", *MODEL, *SEARCH])["fit"]  # type: ignore[no-any-return]


def _candidates(fit: dict[str, Any]) -> list[dict[str, Any]]:
    return fit["fitting"] + fit["not_fitting"]  # type: ignore[no-any-return]


def _find(fit: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    found = [c for c in _candidates(fit) if c["argv"] == argv]
    assert len(found) == 1, f"{argv} not among the candidates"
    return found[0]


def test_the_search_spans_cp_and_pp_beside_dp_and_tp(fit: dict[str, Any]) -> None:
    meshes = [c["mesh"] for c in _candidates(fit)]
    assert any(m.get("cp") == 2 and m.get("tp", 1) > 1 for m in meshes)
    assert {m.get("pp") for m in meshes} >= {2, 4}
    assert any("pp" not in m and "cp" not in m for m in meshes)
    assert any(m.get("pp") == 2 and m.get("cp") == 2 for m in meshes)


@pytest.mark.parametrize(
    "argv",
    [
        ["--mesh", "dp_shard=4,cp=2"],
        ["--mesh", "dp_shard=2,cp=2,tp=2", "--sp", "--ac", "full"],
    ],
)
def test_a_cp_candidates_peak_is_what_plan_traces_with_its_options(fit: dict[str, Any], argv: list[str]) -> None:
    candidate = _find(fit, argv)
    memory = _json(["plan", *MODEL, *argv, "--json"])["memory"]
    assert candidate["peak_bytes"] == memory["peak_bytes"]
    assert candidate["activations_bytes"] == memory["activations_bytes"]
    assert candidate["comm_bytes"]["cp_ring"] > 0
    assert candidate["predicted_step"]["cp_comm_ms"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--mesh", "pp=2,dp_shard=4", "--schedule", "1F1B", "--microbatches", "4"],
        ["--mesh", "pp=2,dp_shard=2,tp=2", "--sp", "--schedule", "1F1B", "--microbatches", "4", "--ac", "selective"],
        ["--mesh", "pp=4,dp_shard=2", "--schedule", "1F1B", "--microbatches", "4", "--ac", "full"],
        ["--mesh", "pp=2,dp_shard=2,cp=2", "--schedule", "1F1B", "--microbatches", "4"],
        ["--mesh", "pp=2,dp_shard=2,cp=2", "--schedule", "1F1B", "--microbatches", "4", "--ac", "full"],
    ],
)
def test_a_pp_candidates_modelled_peak_is_within_minus_10_plus_15_percent_of_the_traced_stages(
    fit: dict[str, Any], argv: list[str]
) -> None:
    candidate = _find(fit, argv)
    memory = _json(["plan", *MODEL, *argv, "--json"])["memory"]
    traced = memory["peak_bytes"]
    assert 0.9 * traced <= candidate["peak_bytes"] <= 1.15 * traced, (candidate["peak_bytes"], traced)
    assert candidate["pipeline"]["peak_stage"] == memory["peak_stage"]
    assert candidate["pipeline"] == {**candidate["pipeline"], "schedule": "1F1B", "microbatches": 4, "modelled": True}


@pytest.mark.parametrize(("schedule", "ac"), [("1F1B", None), ("1F1B", "full"), ("GPipe", None), ("GPipe", "full")])
def test_at_long_sequences_a_pp_candidate_counts_the_heads_logits_once_per_microbatch_held(
    schedule: str, ac: str | None
) -> None:
    """At 2,048 tokens the last stage's logits and their loss are a third of
    its peak: the loss's share counted once (the traced step's activations
    and temporaries), the logits the schedule keeps once per micro-batch in
    flight (GPipe: all of them), the other stages with their blocks'
    temporaries only."""
    argv = ["--mesh", "pp=2,dp_shard=2", "--schedule", schedule, "--microbatches", "4", *([] if ac is None else ["--ac", ac])]
    fit = _json(["plan", *LONG, "--fit", "4x8GiB", "--fit-cp", "1", "--fit-pp", "2", "--schedule", schedule, "--json"])["fit"]
    candidate = _find(fit, argv)
    memory = _json(["plan", *LONG, *argv, "--json"])["memory"]
    traced = memory["peak_bytes"]
    assert 0.9 * traced <= candidate["peak_bytes"] <= 1.15 * traced, (candidate["peak_bytes"], traced)
    assert candidate["pipeline"]["peak_stage"] == memory["peak_stage"]


def test_a_pp_candidates_step_counts_the_bubble_and_divides_the_work_by_its_stages(fit: dict[str, Any]) -> None:
    staged = _find(fit, ["--mesh", "pp=2,dp_shard=4", "--schedule", "1F1B", "--microbatches", "4"])
    flat = _find(fit, ["--mesh", "dp_shard=8"])
    s, f = staged["predicted_step"], flat["predicted_step"]
    assert s["compute_ms"] == pytest.approx(f["compute_ms"] / 2)  # two of four blocks on each stage
    assert s["pipeline_bubble_ms"] == pytest.approx(s["compute_ms"] * (2 - 1) / 4)
    assert s["tokens_per_gpu"] == pytest.approx(f["tokens_per_gpu"] / 2)
    assert staged["comm_bytes"]["pp_p2p"] > 0


def test_a_pp_candidate_reproduces_with_a_pipeline_config(fit: dict[str, Any]) -> None:
    candidate = _find(fit, ["--mesh", "pp=4,dp_shard=2", "--schedule", "1F1B", "--microbatches", "4", "--ac", "full"])
    assert "pipeline_parallel=PipelineParallelConfig(schedule='1F1B', microbatches=4)" in candidate["config"]


def test_pipeline_sizes_a_batch_cannot_feed_are_listed_with_why() -> None:
    fit = _json(["plan", "--preset", "llama", "--layers", "4", "--seq", "256", "--fit", "4x8GiB", "--fit-cp", "1", "--json"])["fit"]
    assert not any("pp" in c["mesh"] for c in _candidates(fit))
    assert any(s.startswith("pp=2, 1F1B:") and "raise --batch" in s for s in fit["skipped"])
    assert any(s.startswith("pp=2, Interleaved1F1B x 2 stages per rank:") and "interleaves nothing" in s for s in fit["skipped"])


def test_cp_is_searched_by_default_only_for_long_sequences() -> None:
    fit = _json(["plan", "--preset", "llama", "--layers", "2", "--seq", "256", "--fit", "2x8GiB", "--json"])["fit"]
    assert not any("cp" in c["mesh"] for c in _candidates(fit))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--fit-cp", "two"), "malformed --fit-cp 'two'"),
        (("--fit-pp", "0"), "--fit-pp '0': sizes must be integers >= 1"),
        (("--schedule", "ZeroBubble"), "--fit models the schedules 1F1B, GPipe, Interleaved1F1B, not 'ZeroBubble'"),
        (("--schedule", "GPipe", "--stages-per-rank", "2"), "1F1B and GPipe run one"),
        (("--stages-per-rank", "1"), "the interleaved candidates need 2 or more stages per rank"),
        (("--layers-per-stage", "1"), "--layers-per-stage apply to a --mesh with a pp axis"),
        (("--mesh", "dp=2", "--fit-pp", "2"), "--fit-pp apply to --fit"),
    ],
)
def test_bad_search_dimensions_are_refused_in_one_line(argv: tuple[str, ...], says: str) -> None:
    fit = () if "--mesh" in argv else ("--fit", "4x8GiB")
    code, out, err = _run(["plan", "--preset", "llama", "--layers", "2", *fit, *argv])
    assert code == 2 and out == ""
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_the_search_tries_interleaved_1f1b_beside_1f1b_with_half_the_bubble(fit: dict[str, Any]) -> None:
    """Same mesh, checkpointing and offload: interleaving two stages per rank
    halves the predicted bubble, doubles each rank's P2P bytes, and holds at
    least 1F1B's activations (its in-flight count is an upper bound)."""
    pairs = 0
    for c in _candidates(fit):
        p = c["pipeline"]
        if p is None or p["schedule"] != "1F1B":
            continue
        twin = [
            d for d in _candidates(fit)
            if d["pipeline"] and d["pipeline"]["schedule"] == "Interleaved1F1B" and d["mesh"] == c["mesh"]
            and (d["activation_checkpointing"], d["offload"]) == (c["activation_checkpointing"], c["offload"])
        ]
        if not twin:
            continue
        (d,) = twin
        pairs += 1
        assert d["pipeline"]["stages_per_rank"] == 2 and d["pipeline"]["peak_stage"] is None
        assert d["predicted_step"]["pipeline_bubble_ms"] == pytest.approx(c["predicted_step"]["pipeline_bubble_ms"] / 2)
        assert d["comm_bytes"]["pp_p2p"] == 2 * c["comm_bytes"]["pp_p2p"]
        assert d["argv"][-2:] == ["--stages-per-rank", "2"] or "--stages-per-rank" in d["argv"]
    assert pairs >= 4


@pytest.fixture(scope="module")
def interleaved_fit() -> dict[str, Any]:
    argv = ["plan", *LONG, "--fit", "4x8GiB", "--fit-cp", "1", "--fit-pp", "2", "--schedule", "Interleaved1F1B", "--json"]
    return _json(argv)["fit"]  # type: ignore[no-any-return]


def test_an_interleaved_candidates_exact_parts_are_what_plan_gives_its_busiest_rank(interleaved_fit: dict[str, Any]) -> None:
    """Where ``plan`` is exact from shapes: each pp rank's parameters,
    gradients and optimizer state over its two stages."""
    found = [c for c in _candidates(interleaved_fit) if c["pipeline"] and not c["offload"]]
    assert found and all(c["pipeline"]["schedule"] == "Interleaved1F1B" for c in found)
    for c in found[:2]:
        model = MODEL[:4]  # the preset without --batch/--seq: shapes only
        data = _json(["plan", *model, *c["argv"], "--json"])
        rank = next(r for r in data["ranks"] if r["rank"] == c["pipeline"]["peak_pp_rank"])
        assert len(rank["stages"]) == 2
        assert (c["params_bytes"], c["grads_bytes"], c["optimizer_bytes"]) == (
            rank["memory"]["params_bytes"],
            rank["memory"]["grads_bytes"],
            rank["memory"]["optimizer_bytes"],
        )


@pytest.mark.parametrize("ac", [None, "selective", "full"])
def test_an_interleaved_candidates_modelled_peak_is_within_minus_10_plus_15_percent_of_its_ranks_tracked_step(
    interleaved_fit: dict[str, Any], ac: str | None
) -> None:
    """Against the plain tracker run of each pp rank's two stages in the
    order torch's Interleaved1F1B gives that rank (``rank_tracker_recipe``),
    at a sequence long enough that the activations in flight are about
    half the peak: within the band 1F1B candidates keep, naming the same rank."""
    argv = ["--mesh", "pp=2,dp_shard=2", "--schedule", "Interleaved1F1B", "--microbatches", "4", "--stages-per-rank", "2"]
    candidate = _find(interleaved_fit, argv + ([] if ac is None else ["--ac", ac]))
    pipeline = PipelineParallelConfig(schedule="Interleaved1F1B", microbatches=4, stages_per_rank=2)
    config = FSDP2Config(pipeline_parallel=pipeline, **({} if ac is None else {"activation_checkpointing": ac}))
    layers, seq = (int(LONG[LONG.index(flag) + 1]) for flag in ("--layers", "--seq"))
    hidden = (1, seq, 1024)  # one sequence per micro-batch (--batch 4, 4 micro-batches), the preset's width
    peaks = [rank_tracker_peak(layers, seq, (2, 2), ("pp", "dp_shard"), config, pp_rank=r, hidden=hidden) for r in (0, 1)]
    tracked = max(peaks)
    assert 0.9 * tracked <= candidate["peak_bytes"] <= 1.15 * tracked, (candidate["peak_bytes"], peaks)
    assert candidate["pipeline"]["peak_pp_rank"] == peaks.index(tracked)


@pytest.mark.parametrize("ac", [None, "full"])
def test_an_interleaved_candidates_modelled_peak_is_within_minus_10_plus_15_percent_of_plans_traced_ranks(
    interleaved_fit: dict[str, Any], ac: str | None
) -> None:
    """Against ``plan``'s own trace of each pp rank with its two stages, as
    1F1B candidates are held against its traced stages."""
    argv = ["--mesh", "pp=2,dp_shard=2", "--schedule", "Interleaved1F1B", "--microbatches", "4", "--stages-per-rank", "2"]
    argv += [] if ac is None else ["--ac", ac]
    candidate = _find(interleaved_fit, argv)
    memory = _json(["plan", *LONG, *argv, "--json"])["memory"]
    assert 0.9 * memory["peak_bytes"] <= candidate["peak_bytes"] <= 1.15 * memory["peak_bytes"], (candidate["peak_bytes"], memory)
    assert candidate["pipeline"]["peak_pp_rank"] == memory["pp_rank"]


def test_an_interleaved_rank_holds_at_most_what_its_order_keeps_at_once() -> None:
    """Rank 1 of 2, two stages (1 and 3), four micro-batches: stage 1 has
    three in flight and stage 3 one, but never at the same moment; with
    stage 3 carrying the head the most held at once is two of stage 1's and
    one of stage 3's."""
    actions = interleaved_1f1b_actions(1, 2, 2, 4)
    assert actions[:6] == (("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1))
    assert most_held(actions, {1: 10.0, 3: 100.0}) == 2 * 10.0 + 100.0
    assert most_held(actions, {1: 10.0, 3: 1.0}) == 3 * 10.0

