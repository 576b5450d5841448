"""``python -m fsdptx plan``: a dry run of FSDP2Manager, driven through ``main``.

Every case calls :func:`fsdptx.cli._main.main` in-process (fast); the real
``python -m fsdptx`` entry point runs in ``test_cli_refusals.py``. HF
models, the memory plan and refusals have files of their own
(``test_cli_*.py``).
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdptx.cli._main import main
from fsdptx.plan._plan import Plan
from fsdptx.cli._report import step_traffic
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.presets import build_preset
from fsdptx.testing import fake_mesh

# llama preset: dim 1024, hidden 2816, vocab 32000, fp32 storage.
DIM, HIDDEN, VOCAB = 1024, 2816, 32000
BLOCK_LINEARS = 4 * DIM * DIM + 3 * DIM * HIDDEN  # attention + MLP projections
BLOCK_NORMS = 2 * DIM

# --------------------------------------------------------------------------- helpers


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``main(["plan", *argv])`` -> (exit code, stdout, stderr)."""
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


def manager_plan(
    preset: str, layers: int, shape: Sequence[int] = (8,), names: Sequence[str] = ("dp",), **config: Any
) -> Plan:
    """The plan the CLI should print, computed with the manager directly."""
    with torch.device("meta"):
        model = build_preset(preset, layers)
    with fake_mesh(shape, names) as mesh:
        return FSDP2Manager(FSDP2Config(**config), mesh).plan(model)


def unit_json(data: dict[str, Any], first_module: str) -> dict[str, Any]:
    return next(u for u in data["units"] if u["modules"][0] == first_module)


FACTORY_SOURCE = textwrap.dedent(
    '''
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16, bias=False)

        def forward(self, x):
            return self.proj(x)

    class Net(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(16, 8, bias=False)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    def build():
        assert torch.empty(1).device.type == "meta", "factory was not called under the meta device"
        return Net()

    def not_a_module():
        return 42

    not_callable = "just a string"
    '''
)


@pytest.fixture
def factory_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A user module ``fsdptx_test_factory`` importable from ``tmp_path``, plus
    ``fsdptx_test_broken_factory`` whose import raises."""
    names = ("fsdptx_test_factory", "fsdptx_test_broken_factory")
    (tmp_path / f"{names[0]}.py").write_text(FACTORY_SOURCE)
    (tmp_path / f"{names[1]}.py").write_text("import a_module_that_does_not_exist_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield names[0]
    for name in names:
        sys.modules.pop(name, None)


# --------------------------------------------------------------------------- the plan is the manager's


def test_json_units_are_the_managers_plan_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    expected = manager_plan("mixed", 2)
    data = run_json(capsys, "--layers", "2")
    assert [tuple(u["modules"]) for u in data["units"]] == [u.modules for u in expected.units]


def test_json_collectives_match_step_traffic_of_the_managers_plan(capsys: pytest.CaptureFixture[str]) -> None:
    traffic = step_traffic(manager_plan("mixed", 2))
    data = run_json(capsys, "--layers", "2")
    assert [(u["all_gathers"], u["reduce_scatters"]) for u in data["units"]] == [
        (t.all_gathers, t.reduce_scatters) for t in traffic
    ]


def test_json_step_totals_are_the_sums_of_the_units(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--layers", "2")
    units = data["units"]
    assert data["step"]["all_gathers"] == sum(u["all_gathers"] for u in units)
    assert data["step"]["reduce_scatters"] == sum(u["reduce_scatters"] for u in units)
    assert data["step"]["all_gather_bytes"] == sum(u["all_gathers"] * u["gathered_bytes"] for u in units)


def test_last_block_does_not_reshard_and_gathers_once(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "3")
    flags = [(u["modules"][0], u["reshard_after_forward"], u["all_gathers"]) for u in data["units"]]
    assert flags == [("layers.0", True, 2), ("layers.1", True, 2), ("layers.2", False, 1), ("", False, 1)]


def test_json_reports_the_mesh_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "1", "--mesh", "dp=2,tp=4")
    assert data["mesh"] == {"dp": 2, "tp": 4}
    assert data["world_size"] == 8


# --------------------------------------------------------------------------- one table, collapsed


def test_repeated_blocks_collapse_into_one_row_and_the_last_block_is_an_exception(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(capsys, "--preset", "llama", "--layers", "6")
    assert code == 0
    assert re.search(r"^block\s+layers\.\{0\.\.4\} \(5 units\)\s+float32->bfloat16\s+True\s", out, re.M), out
    assert re.search(r"^block\s+layers\.5\s+float32->bfloat16\s+False\s", out, re.M), out
    assert not re.search(r"^block\s+layers\.[0-4]\s", out, re.M)


def test_output_has_exactly_one_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--layers", "2")
    assert code == 0
    assert len(re.findall(r"^kind\s+units\s", out, re.M)) == 1
    assert len(re.findall(r"^-+(\s+-+)+$", out, re.M)) == 1


def test_cross_block_unit_is_one_row_naming_every_block(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--layers", "3")
    assert code == 0
    assert re.search(r"^cross-block\s+layers\.\{0\.\.2\}\.sinks \(one unit\)\s+float32->float32\s", out, re.M), out


def test_reshard_column_is_resolved_to_true_or_false(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--layers", "2")
    assert {u["reshard_after_forward"] for u in data["units"]} == {True, False}
    code, out, _ = run_cli(capsys, "--layers", "2")
    assert "None" not in out


def test_json_rows_cover_every_unit_once(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--layers", "4")
    covered = sorted(i for row in data["rows"] for i in row["units"])
    assert covered == list(range(len(data["units"])))


# --------------------------------------------------------------------------- TP, SP, AC, prefetch


def test_tp_mesh_prints_the_tp_styles_per_module(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--preset", "llama", "--layers", "2", "--mesh", "dp=2,tp=2")
    assert code == 0
    assert "tensor parallel: " in out
    assert re.search(r"^\s+layers\.\{0\.\.1\}\.attn\.q_proj\s+colwise$", out, re.M), out
    assert re.search(r"^\s+layers\.\{0\.\.1\}\.mlp\.down_proj\s+rowwise$", out, re.M), out


def test_sp_flag_turns_on_sequence_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--preset", "llama", "--layers", "2", "--mesh", "dp=2,tp=2", "--sp")
    assert code == 0
    assert "tensor parallel with sequence parallelism" in out
    assert re.search(r"layers\.\{0\.\.1\}\.attn_norm\s+sequence_parallel", out)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_ac_flag_checkpoints_every_block(capsys: pytest.CaptureFixture[str], mode: str) -> None:
    code, out, _ = run_cli(capsys, "--preset", "llama", "--layers", "2", "--ac", mode)
    assert code == 0
    assert f"activation checkpointing ({mode}): layers.{{0..1}}" in out


def test_prefetch_chains_are_printed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--preset", "llama", "--layers", "4")
    assert code == 0
    assert "explicit prefetch: 4 units, forward depth 1, backward depth 2" in out


def test_tp_replica_line_only_when_a_tp_axis_exists(capsys: pytest.CaptureFixture[str]) -> None:
    _, with_tp, _ = run_cli(capsys, "--preset", "llama", "--layers", "1", "--mesh", "dp=2,tp=2")
    _, without_tp, _ = run_cli(capsys, "--preset", "llama", "--layers", "1", "--mesh", "dp=2")
    assert "tp-replica reductions" in with_tp
    assert "tp-replica" not in without_tp
    assert "tensor parallel" not in without_tp


# --------------------------------------------------------------------------- bytes per rank


def test_bytes_per_rank_with_dp8_is_exactly_an_eighth_when_dims_divide(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "2", "--mesh", "dp=8")
    for u in data["units"]:
        assert u["bytes_per_rank"] == u["bytes"] // 8, u["modules"]
    assert data["memory"]["params_bytes"] == data["model_bytes"] // 8


def test_bytes_per_rank_account_for_tp(capsys: pytest.CaptureFixture[str]) -> None:
    # Linears split over dp x tp = 8 ranks; the replicated norms over dp = 2 only.
    data = run_json(capsys, "--preset", "llama", "--layers", "2", "--mesh", "dp=2,tp=4")
    assert unit_json(data, "layers.0")["bytes_per_rank"] == 4 * (BLOCK_LINEARS // 8 + BLOCK_NORMS // 2)
    # Root: embedding (row-wise) and lm_head (column-wise) over 8, final norm over 2.
    assert unit_json(data, "")["bytes_per_rank"] == 4 * (2 * VOCAB * DIM // 8 + DIM // 2)


def test_tp_gathered_bytes_are_tp_local(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "1", "--mesh", "dp=2,tp=4")
    # bf16 compute: the all-gather rebuilds this TP rank's slice of the block only.
    assert unit_json(data, "layers.0")["gathered_bytes"] == 2 * (BLOCK_LINEARS // 4 + BLOCK_NORMS)


def test_hsdp_shards_over_dp_shard_only(capsys: pytest.CaptureFixture[str]) -> None:
    hsdp = run_json(capsys, "--preset", "llama", "--layers", "1", "--mesh", "dp_replicate=2,dp_shard=4")
    assert hsdp["dims"]["dp_shard"] == 4
    assert hsdp["memory"]["params_bytes"] == hsdp["model_bytes"] // 4


def test_mixed_preset_gates_pad_and_are_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    # The bf16 gates have shape (1, dim): on 8 ranks every rank allocates the one row.
    data = run_json(capsys, "--layers", "3", "--mesh", "dp=8")
    flagged = {u["modules"][0] for u in data["units"] if u["padding_flagged"]}
    assert flagged == {"layers.0.gate", "layers.1.gate", "layers.2.gate"}
    gate = unit_json(data, "layers.0.gate")
    assert gate["bytes_per_rank"] == 2 * DIM and gate["padding_bytes_per_rank"] == 2 * DIM - 2 * DIM // 8
    code, out, _ = run_cli(capsys, "--layers", "3", "--mesh", "dp=8")
    assert "(!) shards padded by more than 25%" in out
    assert re.search(r"^dtype\s+layers\.\{0\.\.1\}\.gate \(2 units\)\s.*\+700% \(!\)", out, re.M), out


def test_llama_has_no_padding_on_dp8(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "1")
    assert data["memory"]["padding_bytes"] == 0
    assert not any(u["padding_flagged"] for u in data["units"])


# --------------------------------------------------------------------------- --mp


def test_mp_none_disables_mixed_precision(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--layers", "2", "--mp", "none")
    assert data["mp_policy"] is None
    assert {(u["storage_dtype"], u["compute_dtype"]) for u in data["units"]} == {
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
    }


def test_mp_none_gathers_full_precision_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    bf16 = run_json(capsys, "--preset", "llama", "--layers", "2")
    none = run_json(capsys, "--preset", "llama", "--layers", "2", "--mp", "none")
    assert none["step"]["all_gather_bytes"] == 2 * bf16["step"]["all_gather_bytes"]


def test_mp_fp16_computes_in_fp16(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "1", "--mp", "fp16")
    assert {u["compute_dtype"] for u in data["units"]} == {"float16"}
    assert data["mp_policy"] == {"param_dtype": "float16", "reduce_dtype": "float32"}


# --------------------------------------------------------------------------- --factory


def test_factory_is_built_on_the_meta_device_and_planned(
    capsys: pytest.CaptureFixture[str], factory_module: str
) -> None:
    spec = f"{factory_module}:build"
    data = run_json(capsys, "--factory", spec, "--mesh", "dp=4")
    assert data["model"] == spec
    assert [u["modules"] for u in data["units"]] == [["layers.0"], ["layers.1"], [""]]
    # fp32 Linear(16, 16) = 1024 B, head Linear(16, 8) = 512 B, over dp=4.
    assert [u["bytes_per_rank"] for u in data["units"]] == [256, 256, 128]


# --------------------------------------------------------------------------- errors

BAD_ARGUMENTS: list[tuple[Sequence[str], str]] = [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--mesh", "dp"], "malformed --mesh 'dp'"),
    (["--mesh", "dp=0"], "malformed --mesh 'dp=0'"),
    (["--mesh", "dp=two"], "malformed --mesh 'dp=two'"),
    (["--mesh", "dp=2,dp=2"], "appears twice"),
    (["--mesh", "tp=4"], "no data-parallel axis"),
    (["--mesh", "dp=2,xp=2"], "unknown axis 'xp'"),
    (["--factory", "fsdptx_no_such_module_xyz:build"], "cannot import 'fsdptx_no_such_module_xyz'"),
    (["--factory", "fsdptx_test_broken_factory:build"], "cannot import 'fsdptx_test_broken_factory'"),
    (["--factory", "fsdptx_test_factory"], "malformed --factory"),
    (["--factory", "fsdptx_test_factory:missing"], "no callable 'missing'"),
    (["--factory", "fsdptx_test_factory:not_callable"], "no callable 'not_callable'"),
    (["--factory", "fsdptx_test_factory:not_a_module"], "returned int, not an nn.Module"),
    (["--layers", "0"], "--layers must be between 1 and"),
    (["--layers", "two"], "invalid int value"),
    (["--mp", "fp8"], "invalid choice"),
    (["--ac", "some"], "invalid choice"),
    (["--optimizer", "lion"], "invalid choice"),
    (["--dtype", "bf16"], "--dtype applies to --hf models"),
    (["--hf-config", "a=1"], "--hf-config needs --hf"),
    (["--preset", "llama", "--factory", "fsdptx_test_factory:build"], "not allowed with"),
    (["--preset", "llama", "--mesh", "dp=2,tp=3"], "does not fit tp=3"),
    (["--unknown-flag"], "unrecognized arguments"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_give_one_line_error_and_exit_2(
    capsys: pytest.CaptureFixture[str], factory_module: str, argv: Sequence[str], message: str
) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fsdptx: error: ")
    assert message in lines[0]


def test_missing_subcommand_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    _, err = capsys.readouterr()
    assert len(err.splitlines()) == 1
    assert err.startswith("fsdptx: error: ")


def test_help_exits_0_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--help"]) == 0
    out, _ = capsys.readouterr()
    assert "--mesh" in out and "--hf" in out and "--optimizer" in out
