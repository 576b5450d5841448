"""``python -m fsdptx plan``: the dry-run planner, driven through ``main``.

Most cases call :func:`fsdptx._cli.main` in-process (fast); one runs the real
``python -m fsdptx`` entry point in a subprocess.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdptx._cli import DEFAULT_PIPELINE, main
from fsdptx._plan import Plan, summarize_modules
from fsdptx._report import step_traffic
from fsdptx._transforms import plan
from fsdptx.presets import build_preset

BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

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


def expected_plan(preset: str, layers: int, mp: MixedPrecisionPolicy | None = BF16_POLICY) -> Plan:
    """The plan the CLI should print, computed independently of the CLI."""
    with torch.device("meta"):
        model = build_preset(preset, layers)
    return plan(model, DEFAULT_PIPELINE, mp_policy=mp)


def dtype_arrow(storage: torch.dtype | None, compute: torch.dtype | None) -> str:
    def name(d: torch.dtype | None) -> str:
        return "-" if d is None else str(d).removeprefix("torch.")

    return f"{name(storage)}->{name(compute)}"


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


# --------------------------------------------------------------------------- text output


def test_text_output_lists_every_unit_with_storage_to_compute_dtypes(capsys: pytest.CaptureFixture[str]) -> None:
    expected = expected_plan("mixed", 2)
    code, out, _ = run_cli(capsys, "--layers", "2", "--mesh", "dp=8")
    assert code == 0
    lines = out.splitlines()
    assert len(expected.units) == 6
    for unit in expected.units:
        modules = summarize_modules(unit.modules)
        arrow = dtype_arrow(unit.storage_dtype, unit.compute_dtype)
        assert any(modules in line and arrow in line for line in lines), (modules, arrow, out)


def test_text_output_shows_the_three_dtype_pairs_of_the_mixed_preset(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--layers", "2")
    assert code == 0
    sinks = next(line for line in out.splitlines() if "layers.*.sinks (x2)" in line)
    gate = next(line for line in out.splitlines() if "layers.0.gate" in line)
    block = next(line for line in out.splitlines() if re.search(r"\blayers\.0\s", line) and "->" in line)
    assert "float32->float32" in sinks
    assert "bfloat16->bfloat16" in gate
    assert "float32->bfloat16" in block


def test_text_output_prints_per_step_totals(capsys: pytest.CaptureFixture[str]) -> None:
    traffic = step_traffic(expected_plan("mixed", 2))
    gathers = sum(t.all_gathers for t in traffic)
    scatters = sum(t.reduce_scatters for t in traffic)
    code, out, _ = run_cli(capsys, "--layers", "2")
    assert code == 0
    match = re.search(r"per training step: (\d+) all-gathers .*?, (\d+) reduce-scatters", out)
    assert match is not None, out
    assert (int(match[1]), int(match[2])) == (gathers, scatters) == (10, 6)


def test_text_and_json_report_the_same_step_totals(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--layers", "2")
    code, out, _ = run_cli(capsys, "--layers", "2")
    assert code == 0
    s = data["step"]
    assert (
        f"per training step: {s['all_gathers']} all-gathers ({s['all_gather_bytes']:,} B unsharded), "
        f"{s['reduce_scatters']} reduce-scatters ({s['reduce_scatter_bytes']:,} B unsharded); "
        f"{data['bytes_per_rank']:,} B of parameters per rank"
    ) in out


# --------------------------------------------------------------------------- --json


def test_json_has_every_unit_with_bytes_per_rank_and_collectives(capsys: pytest.CaptureFixture[str]) -> None:
    expected = expected_plan("mixed", 2)
    data = run_json(capsys, "--layers", "2")
    assert [tuple(u["modules"]) for u in data["units"]] == [u.modules for u in expected.units]
    for u in data["units"]:
        assert isinstance(u["bytes_per_rank"], int) and u["bytes_per_rank"] > 0
        assert u["all_gathers"] in (1, 2)
        assert u["reduce_scatters"] == 1


def test_json_units_match_step_traffic_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    traffic = step_traffic(expected_plan("mixed", 2))
    data = run_json(capsys, "--layers", "2")
    assert [(u["all_gathers"], u["reduce_scatters"]) for u in data["units"]] == [
        (t.all_gathers, t.reduce_scatters) for t in traffic
    ]


def test_json_step_totals_are_the_sums_of_the_units(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--layers", "2")
    units = data["units"]
    assert data["step"]["all_gathers"] == sum(u["all_gathers"] for u in units)
    assert data["step"]["reduce_scatters"] == sum(u["reduce_scatters"] for u in units)
    assert data["bytes_per_rank"] == sum(u["bytes_per_rank"] for u in units)


def test_json_reports_the_mesh_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--layers", "2", "--mesh", "dp=2,tp=4")
    assert data["mesh"] == {"dp": 2, "tp": 4}


# --------------------------------------------------------------------------- bytes per rank


def test_bytes_per_rank_with_dp8_is_exactly_an_eighth_when_dims_divide(capsys: pytest.CaptureFixture[str]) -> None:
    # llama: vocab 32000, dim 1024, hidden 2816: every dim-0 is divisible by 8.
    data = run_json(capsys, "--preset", "llama", "--layers", "2", "--mesh", "dp=8")
    for u in data["units"]:
        assert u["bytes"] % 8 == 0
        assert u["bytes_per_rank"] == u["bytes"] // 8, u["modules"]


def test_bytes_per_rank_with_dp8_is_about_an_eighth_for_the_mixed_preset(capsys: pytest.CaptureFixture[str]) -> None:
    # The bf16 gates have shape (1, dim): rank 0 holds their one row, so they
    # are the only units off by more than rounding.
    data = run_json(capsys, "--layers", "2", "--mesh", "dp=8")
    total = sum(u["bytes"] for u in data["units"])
    gate_bytes = sum(u["bytes"] for u in data["units"] if u["modules"][0].endswith(".gate"))
    assert total / 8 <= data["bytes_per_rank"] <= total / 8 + gate_bytes


def test_mesh_with_tp_shards_over_dp_only(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "2", "--mesh", "dp=2,tp=4")
    for u in data["units"]:
        assert u["bytes_per_rank"] == u["bytes"] // 2, u["modules"]


# --------------------------------------------------------------------------- --factory and --mp


def test_factory_is_built_on_the_meta_device_and_planned(
    capsys: pytest.CaptureFixture[str], factory_module: str
) -> None:
    spec = f"{factory_module}:build"
    data = run_json(capsys, "--factory", spec, "--mesh", "dp=4")
    assert data["model"] == spec
    assert [u["modules"] for u in data["units"]] == [["layers.0"], ["layers.1"], [""]]
    # fp32 Linear(16, 16) = 1024 B, head Linear(16, 8) = 512 B, over dp=4.
    assert [u["bytes_per_rank"] for u in data["units"]] == [256, 256, 128]


def test_mp_none_computes_in_the_storage_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--layers", "2", "--mp", "none")
    pairs = {(u["storage_dtype"], u["compute_dtype"]) for u in data["units"]}
    assert pairs == {("float32", "float32"), ("bfloat16", "bfloat16")}


def test_mp_none_gathers_full_precision_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    bf16 = run_json(capsys, "--preset", "llama", "--layers", "2")
    none = run_json(capsys, "--preset", "llama", "--layers", "2", "--mp", "none")
    assert none["step"]["all_gather_bytes"] == 2 * bf16["step"]["all_gather_bytes"]


# --------------------------------------------------------------------------- errors

BAD_ARGUMENTS: list[tuple[Sequence[str], str]] = [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--mesh", "dp"], "malformed --mesh 'dp'"),
    (["--mesh", "dp=0"], "malformed --mesh 'dp=0'"),
    (["--mesh", "dp=two"], "malformed --mesh 'dp=two'"),
    (["--mesh", "dp=2,dp=2"], "appears twice"),
    (["--mesh", "tp=4"], "no data-parallel axis"),
    (["--factory", "fsdptx_no_such_module_xyz:build"], "cannot import 'fsdptx_no_such_module_xyz'"),
    (["--factory", "fsdptx_test_broken_factory:build"], "cannot import 'fsdptx_test_broken_factory'"),
    (["--factory", "fsdptx_test_factory"], "malformed --factory"),
    (["--factory", "fsdptx_test_factory:missing"], "no callable 'missing'"),
    (["--factory", "fsdptx_test_factory:not_callable"], "no callable 'not_callable'"),
    (["--factory", "fsdptx_test_factory:not_a_module"], "returned int, not an nn.Module"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--mp", "fp8"], "invalid choice"),
    (["--preset", "llama", "--factory", "fsdptx_test_factory:build"], "not allowed with"),
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


# --------------------------------------------------------------------------- the real entry point


def test_python_m_fsdptx_plan_runs_in_a_subprocess() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fsdptx", "plan", "--layers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("fsdptx plan: mixed on fake mesh (dp=8)")
    assert "layers.*.sinks (x2)" in proc.stdout
    assert re.search(r"per training step: 10 all-gathers .*, 6 reduce-scatters", proc.stdout)
    assert "Traceback" not in proc.stderr
