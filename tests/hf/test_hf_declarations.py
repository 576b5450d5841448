"""The Hugging Face declaration readers on plain modules (no transformers needed),
and the lazy import of ``transformers``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from fsdptx.hf import (
    hf_expert_modules,
    hf_fp32_compute_tokens,
    hf_replica_reductions,
    hf_tied_weights,
    hf_tp_plan,
)


class Declared(nn.Module):
    """A stand-in for an HF model whose ``post_init`` merged its plans."""

    def __init__(self, **declarations: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        for name, value in declarations.items():
            setattr(self, name, value)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)


def test_module_without_declarations_reads_as_empty() -> None:
    m = nn.Linear(2, 2)
    assert (hf_tp_plan(m), hf_tied_weights(m), hf_replica_reductions(m), hf_expert_modules(m)) == ({}, {}, {}, ())


def test_tp_plan_of_a_wrapped_model_is_prefixed_with_its_fqn() -> None:
    inner = Declared(_tp_plan={"layers.*.q_proj": "colwise", "head": "colwise_gather_output"})
    wrapper = nn.ModuleDict({"lm": inner})
    assert hf_tp_plan(wrapper) == {"lm.layers.*.q_proj": "colwise", "lm.head": "colwise_gather_output"}


def test_tp_plan_that_is_not_a_mapping_raises_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"Declared\._tp_plan must be a mapping"):
        hf_tp_plan(Declared(_tp_plan=["layers.*.q_proj"]))


def test_tp_plan_with_a_non_str_style_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"_tp_plan maps 'head' to 3"):
        hf_tp_plan(Declared(_tp_plan={"head": 3}))


@pytest.mark.parametrize(
    ("compute_dtype", "expected"),
    [
        (torch.bfloat16, ("router",)),
        (torch.float32, ("router",)),
        (None, ("router",)),
        (torch.float16, ("norm", "router")),
    ],
)
def test_strict_tokens_always_count_and_non_strict_only_for_fp16(
    compute_dtype: torch.dtype | None, expected: tuple[str, ...]
) -> None:
    m = Declared(_keep_in_fp32_modules_strict={"router"}, _keep_in_fp32_modules=["norm"])
    assert hf_fp32_compute_tokens(m, compute_dtype) == expected


def test_bare_string_keep_in_fp32_is_one_name_not_its_letters() -> None:
    # fsdptx's one rule for names: a bare string is one name, everywhere.
    assert hf_fp32_compute_tokens(Declared(_keep_in_fp32_modules_strict="router"), torch.bfloat16) == ("router",)


def test_non_str_keep_in_fp32_entry_raises_type_error_naming_the_attribute() -> None:
    with pytest.raises(TypeError, match=r"_keep_in_fp32_modules must hold names \(str\)"):
        hf_fp32_compute_tokens(Declared(_keep_in_fp32_modules=["norm", 1]), torch.float16)


def test_tied_weights_dict_maps_alias_to_source() -> None:
    m = Declared(_tied_weights_keys={"head.weight": "embed.weight"})
    assert hf_tied_weights(m) == {"head.weight": "embed.weight"}


def test_tied_weights_list_resolves_the_source_by_parameter_identity() -> None:
    m = Declared(_tied_weights_keys=["head.weight"])
    m.head.weight = m.embed.weight
    assert hf_tied_weights(m) == {"head.weight": "embed.weight"}


def test_tied_weights_list_entry_that_is_not_tied_is_left_out() -> None:
    assert hf_tied_weights(Declared(_tied_weights_keys=["head.weight"])) == {}


def test_bare_string_tied_weights_keys_is_one_name() -> None:
    m = Declared(_tied_weights_keys="head.weight")
    m.head.weight = m.embed.weight
    assert hf_tied_weights(m) == {"head.weight": "embed.weight"}


def test_tied_weights_keys_of_another_type_raises_type_error_naming_the_attribute() -> None:
    with pytest.raises(TypeError, match=r"_tied_weights_keys must be a name \(str\) or an iterable of names"):
        hf_tied_weights(Declared(_tied_weights_keys=3))


def test_replicated_with_grad_allreduce_entries_reduce_with_sum_and_others_are_unmarked() -> None:
    plan = {"layers.*.q_norm": "replicated_with_grad_allreduce", "layers.*.q_proj": "colwise"}
    assert hf_replica_reductions(Declared(_tp_plan=plan)) == {"layers.*.q_norm": "sum"}


def test_expert_modules_come_from_tp_and_ep_plans() -> None:
    m = Declared(
        _tp_plan={"layers.*.mlp.experts": "moe_tp_experts", "layers.*.mlp.experts.down_proj": "rowwise"},
        _ep_plan={"mtp.mlp.experts": "ep_dispatch_experts", "mtp.mlp.experts.down_proj": "grouped_gemm"},
    )
    assert hf_expert_modules(m) == ("layers.*.mlp.experts", "mtp.mlp.experts")


def test_importing_fsdptx_hf_does_not_import_transformers() -> None:
    done = _run("import sys, fsdptx.hf; print('transformers' in sys.modules)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_build_without_transformers_raises_import_error_naming_the_extra() -> None:
    done = _run(
        "import sys; sys.modules['transformers'] = None\n"
        "from fsdptx.hf import build_hf_model\n"
        "try:\n    build_hf_model('llama')\n"
        "except ImportError as e:\n    print(e)\n"
    )
    assert done.returncode == 0, done.stderr
    assert 'pip install "fsdptx[hf]"' in done.stdout
