"""A MoE model under sequence parallelism costs no more than torchtitan's MoE
pattern: TP collectives of one training step (forward and backward) on a
fake (dp=2, tp=2) mesh, for Hugging Face Mixtral and Qwen3-MoE with their
declared plans, against the same models parallelized by hand in
torchtitan's pattern (``titan_pattern``: the block gathers its input and
reduce-scatters the experts' ``Partial`` sum).

Parity of the two is in ``test_moe_tp_gloo.py``. Here: how many
collectives of which size, which style the MoE block gets, and the check
that keeps a block from reduce-scattering anything but its experts' output.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

import fsdptx  # noqa: E402
from fsdptx.testing import Collective, fake_mesh, record_collectives  # noqa: E402
from fsdptx import PlanningError  # noqa: E402
from fsdptx.tp import ExpertsParallel, ExpertsSequence, WholeSequence  # noqa: E402

import hf_zoo  # noqa: E402
from titan_pattern import parallelize_by_hand  # noqa: E402

TP_GROUP = (0, 1)  # rank 0's TP peers on a (dp=2, tp=2) mesh
BATCH, SEQ = 2, 16
# hidden states of the whole batch, fp32: what a MoE block's all-gather, reduce-scatter
# and its experts' input-gradient all-reduce carry
ACTIVATION = BATCH * SEQ * hf_zoo.HIDDEN * 4
LAYOUTS = {"mixtral": "hf_mixtral", "qwen3_moe": "hf_qwen3_moe"}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = getattr(hf_zoo, name)("cpu", torch.float32)
    return model


def _tokens() -> torch.Tensor:
    return torch.arange(BATCH * SEQ).reshape(BATCH, SEQ) % hf_zoo.VOCAB


def _step(model: nn.Module) -> list[Collective]:
    tokens = _tokens()
    with record_collectives() as calls:
        logits = model(input_ids=tokens).logits
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    return calls


def _nbytes(c: Collective) -> int:
    return max(torch.Size(s).numel() * d.itemsize for s, d in zip(c.shapes, c.dtypes))


def _tally(calls: list[Collective]) -> Counter[tuple[str, int]]:
    return Counter((c.op, _nbytes(c)) for c in calls if c.group == TP_GROUP)


@functools.cache
def _measure(name: str) -> dict[str, Counter[tuple[str, int]]]:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        hand = _step(parallelize_by_hand(_build(name), LAYOUTS[name], mesh))
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        model = _build(name)
        fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None), mesh).parallelize(model)
        ours = _step(model)
        with record_collectives() as sync:
            fsdptx.synchronize_tp_replica_gradients([model], mesh)
    return {"hand": _tally(hand), "ours": _tally(ours), "sync": _tally(sync)}


def test_mixtral_step_tp_collectives_match_torchtitans_moe_pattern_in_count_and_bytes() -> None:
    found = _measure("mixtral")
    assert found["ours"] == found["hand"]


def test_qwen3_moe_step_moves_torchtitans_collectives_less_its_per_layer_q_k_norm_all_reduces() -> None:
    """torchtitan's q/k norms are ``SequenceParallel(sequence_dim=2)``: one
    all-reduce of each norm's weight gradient per layer in backward. The
    declared plan marks them ``replicated_with_grad_allreduce``: summed in
    the once-per-step TP-replica sync's one bucket instead."""
    found = _measure("qwen3_moe")
    norm_grad = 16 * 4  # head_dim, fp32
    assert found["hand"] - found["ours"] == Counter({("all_reduce", norm_grad): 2 * hf_zoo.LAYERS})
    assert not found["ours"] - found["hand"]
    assert sum(found["sync"].values()) == 2, found["sync"]  # the layout agreement and one bucket


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_moe_layer_all_reduces_one_activation_the_experts_input_gradient(name: str) -> None:
    """Forward: all-gather in, reduce-scatter out. Backward: the experts'
    input gradient is the only activation all-reduced (the block's output
    was all-reduced too before the block reduce-scattered it). Activation
    reduce-scatters per step: the embedding's, then per layer the
    attention's and the MoE block's in forward and the attention gather's in
    backward, and the head gather's in backward."""
    found = _measure(name)
    assert found["ours"][("all_reduce", ACTIVATION)] == hf_zoo.LAYERS
    assert found["ours"][("reduce_scatter_tensor", ACTIVATION)] == 3 * hf_zoo.LAYERS + 2


# ------------------------------------------------------------ the MoE block's style


def _plan(model: nn.Module, **config: Any) -> fsdptx.Plan:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        return fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None, **config), mesh).plan(model)


def _tp_styles(plan: fsdptx.Plan) -> dict[str, Any]:
    assert plan.tensor_parallel is not None
    return {a.module: a.parallel_style for a in plan.tensor_parallel.assignments}


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
def test_a_block_of_router_and_split_experts_reduce_scatters_the_experts_partial_sums(name: str) -> None:
    plan = _plan(getattr(hf_zoo, name)())
    styles = _tp_styles(plan)
    for layer in range(hf_zoo.LAYERS):
        block, experts = f"model.layers.{layer}.mlp", f"model.layers.{layer}.mlp.experts"
        assert type(styles[block]).__name__ == "ExpertsSequence", styles[block]
        assert isinstance(styles[experts], ExpertsParallel) and styles[experts].partial_output
    assert "reduce-scatter the experts' partial sums out" in str(plan)


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3"])
def test_a_block_with_a_shared_expert_all_reduces_its_experts_and_slices(name: str) -> None:
    """A shared expert (whole, or TP-split with an all-reduced output) adds
    whole values to the experts' output: reduce-scattering the sum would
    count them once per TP rank."""
    styles = _tp_styles(_plan(getattr(hf_zoo, name)()))
    moe_blocks = [f for f, s in styles.items() if isinstance(s, ExpertsParallel)]
    assert moe_blocks
    for experts in moe_blocks:
        assert isinstance(styles[experts.removesuffix(".experts")], WholeSequence)
        assert not styles[experts].partial_output


def test_a_block_that_adds_to_its_experts_output_raises_in_forward_instead_of_reduce_scattering_it() -> None:
    """The planner cannot read a block's forward: one that adds a whole
    value to the experts' partial sum (here the block's input, out of place
    and in place) would be reduce-scattered wrong, so the forward refuses."""
    for combine in (lambda out, x: out + x, lambda out, x: out.add_(x)):
        with fake_mesh((2, 2), ("dp", "tp")) as mesh:
            model = _build("mixtral")
            block = model.get_submodule("model.layers.1.mlp")
            forward = block.forward
            block.forward = lambda hidden_states, f=forward, c=combine: c(f(hidden_states), hidden_states)  # type: ignore[method-assign]
            fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None), mesh).parallelize(model)
            with pytest.raises(RuntimeError, match=r"'model.layers.1.mlp' .*not its experts' output.*WholeSequence"):
                model(input_ids=_tokens())


def test_such_a_block_runs_under_an_explicit_whole_sequence_entry() -> None:
    """What the error advises: the block named ``WholeSequence()`` in the
    plan keeps its experts all-reducing their output, and the forward runs."""
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        model = _build("mixtral")
        block = model.get_submodule("model.layers.1.mlp")
        forward = block.forward
        block.forward = lambda hidden_states: forward(hidden_states) + hidden_states  # type: ignore[method-assign]
        plan = {**model._tp_plan, "model.layers.*.mlp": WholeSequence()}  # type: ignore[dict-item]
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None, tp_plan=plan), mesh)
        styles = _tp_styles(manager.plan(model))
        assert isinstance(styles["model.layers.1.mlp"], WholeSequence)
        assert not styles["model.layers.1.mlp.experts"].partial_output
        manager.parallelize(model)
        logits = model(input_ids=_tokens()).logits
        assert logits.shape == (BATCH, SEQ, hf_zoo.VOCAB)


def test_a_moe_plan_read_back_from_json_rebuilds_its_styles_and_applies_with_the_same_collectives() -> None:
    """fsdptx's own styles take arguments (the experts' parameter styles,
    the block's experts): a plan file keeps them, so a reviewed plan can be
    applied as it was saved."""
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        config = fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None)
        model = _build("mixtral")
        back = fsdptx.plan_from_json(fsdptx.plan_to_json(fsdptx.FSDP2Manager(config, mesh).plan(model)))
        styles = _tp_styles(back)
        assert type(styles["model.layers.0.mlp"]).__name__ == "ExpertsSequence"
        assert isinstance(styles["model.layers.0.mlp.experts"], ExpertsParallel)
        assert styles["model.layers.0.mlp.experts"].partial_output
        fsdptx.apply_plan(back, model, mesh)
        loaded = _tally(_step(model))
    assert loaded == _measure("mixtral")["ours"]



def test_the_check_keeps_each_expert_output_so_a_new_tensor_never_passes_for_it() -> None:
    """The experts' output is held until the block returns: a block that
    computes a new tensor from it (which could reuse a freed tensor's
    identity) is refused every time."""
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        model = _build("mixtral")
        block = model.get_submodule("model.layers.1.mlp")
        forward = block.forward
        block.forward = lambda hidden_states: (forward(hidden_states) * 1.0) + hidden_states  # type: ignore[method-assign]
        fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None), mesh).parallelize(model)
        for _ in range(20):
            with pytest.raises(RuntimeError, match="not its experts' output"):
                model(input_ids=_tokens())


def test_a_moe_block_runs_under_inference_mode() -> None:
    """Inference tensors keep no version counter and no view base: the
    check compares storages there."""
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        model = _build("mixtral")
        fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None), mesh).parallelize(model)
        with torch.inference_mode():
            logits = model(input_ids=_tokens()).logits
        assert logits.shape == (BATCH, SEQ, hf_zoo.VOCAB)


def _experts_plan(model: nn.Module, **experts: Any) -> dict[str, Any]:
    """The model's declared plan with the experts given as a style object."""
    plan = {k: v for k, v in model._tp_plan.items() if ".experts" not in k}  # type: ignore[union-attr]
    params = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    return {**plan, "model.layers.*.mlp.experts": ExpertsParallel(params, **experts)}


def test_a_block_named_experts_sequence_over_experts_that_all_reduce_is_refused_at_planning() -> None:
    """Reduce-scattering experts that already all-reduced would count their
    output tp times."""
    model = _build("mixtral")
    plan = {**_experts_plan(model), "model.layers.*.mlp": ExpertsSequence(("experts",))}
    with pytest.raises(PlanningError, match=r"'model.layers.0.mlp' \(ExpertsSequence\) reduce-scatters .*partial_output=True"):
        _plan(model, tp_plan=plan)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp-whole-block"])
def test_experts_handing_on_partial_sums_outside_an_experts_sequence_block_are_refused_at_planning(sp: bool) -> None:
    model = _build("mixtral")
    plan = _experts_plan(model, partial_output=True)
    if sp:
        plan["model.layers.*.mlp"] = WholeSequence()
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=sp, mp_policy=None, tp_plan=plan), mesh)
        with pytest.raises(PlanningError, match=r"'model.layers.0.mlp.experts' hands on its experts' partial sums"):
            manager.plan(model)


@pytest.mark.parametrize("experts", [(), ("",), ("experts", "")], ids=["none", "the-block-itself", "one-empty"])
def test_an_experts_sequence_must_name_experts_inside_its_block(experts: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="non-empty module paths"):
        ExpertsSequence(experts)


def test_partial_output_keeps_the_style_s_class_and_settings() -> None:
    class Custom(ExpertsParallel):
        pass

    style = Custom({"down_proj": "rowwise"})
    style.src_data_rank = None
    partial = style.with_partial_output()
    assert type(partial) is Custom and partial.src_data_rank is None and partial.partial_output
    assert not style.partial_output and partial.params == style.params and partial.params is not style.params


def test_a_moe_plan_saved_after_applying_it_reads_back_and_applies_again() -> None:
    """Torch records the source rank on the styles it applies; a plan file
    written afterwards still rebuilds them."""
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        config = fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None)
        applied = fsdptx.FSDP2Manager(config, mesh).plan(first := _build("mixtral"))
        fsdptx.apply_plan(applied, first, mesh)
        back = fsdptx.plan_from_json(fsdptx.plan_to_json(applied))
        kinds = {type(a.parallel_style).__name__ for a in back.tensor_parallel.assignments}  # type: ignore[union-attr]
        assert "DescribedStyle" not in kinds and "ExpertsSequence" in kinds
        model = _build("mixtral")
        fsdptx.apply_plan(back, model, mesh)
        assert _tally(_step(model)) == _measure("mixtral")["ours"]
