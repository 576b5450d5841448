"""Models parallelized by hand in torchtitan's pattern: the baseline fsdptx's
tensor and sequence parallelism is compared with (parity and collectives).

torchtitan's ``apply_tp`` (Llama 3, v0.2.2): the embedding reduce-scatters
its output onto the sequence (``RowwiseParallel(input_layouts=Replicate(),
output_layouts=Shard(1))``); every norm is ``SequenceParallel()``; attention
and MLP get ``PrepareModuleInput(Shard(1) -> Replicate)`` (a DTensor handed
in: one all-gather, one reduce-scatter in backward); q/k/v and gate/up are
``ColwiseParallel()``, o and down ``RowwiseParallel(output_layouts=Shard(1))``;
the head is ``ColwiseParallel(input_layouts=Shard(1))`` with ``Replicate``
or, under loss parallelism, vocabulary-sharded DTensor logits. Then
composable ``checkpoint`` per block and ``fully_shard`` per block and root.

Its MoE pattern (``apply_moe_ep_tp`` for Llama 4, Qwen3, DeepSeek-V3):
the MoE block is ``PrepareModuleInputOutput`` (``Shard(1)`` in, gathered
to a plain ``Replicate``; the output a ``Partial`` sum reduce-scattered to
``Shard(1)``); the router computes whole on every rank (``NoParallel``:
no collective); the experts are ``TensorParallel`` (``w1``/``w3``
``Shard(1)``, ``w2`` ``Shard(2)``; the routed input enters with
``grad_placements=Partial``, so its gradient is all-reduced); Qwen3's
q/k norms are ``SequenceParallel(sequence_dim=2)`` over the local heads.
On a Hugging Face experts module (:class:`ExpertsTensorParallel`) the
packed gate|up weight splits per half, and the routing weights, which
enter the experts there, get the routed input's Partial gradient too.

:func:`explicit_plan` is the same as a dict of torch styles by glob, for
``FSDP2Config(tp_plan=...)``: "a plan written the torchtitan way".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["LAYOUTS", "ExpertsTensorParallel", "Layout", "explicit_plan", "parallelize_by_hand"]


@dataclass(frozen=True)
class Layout:
    """Where a model keeps what torchtitan's pattern touches."""

    embedding: str
    blocks: str  # the glob of the blocks
    norms: tuple[str, ...]  # block-relative
    regions: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]  # region -> (colwise, rowwise), block-relative
    final_norm: str
    head: str
    keyword: str | None = None  # the region input's keyword, where the block passes it by name
    # Hugging Face models derive positions from the embedding output's
    # length: it stays a Shard(1) DTensor (whose length reads whole) until
    # the first block takes its local part.
    dtensor_embedding: bool = False
    moe: str | None = None  # the block-relative MoE block (router ``gate``, ``experts``)
    head_norms: tuple[str, ...] = ()  # block-relative per-head norms after colwise projections


LAYOUTS: dict[str, Layout] = {
    "titan": Layout(
        "tok_embeddings",
        "layers.*",
        ("attention_norm", "ffn_norm"),
        {"attention": (("wq", "wk", "wv"), ("wo",)), "feed_forward": (("w1", "w3"), ("w2",))},
        "norm",
        "output",
    ),
    "decoder": Layout(
        "embed_tokens",
        "layers.*",
        ("attn_norm", "mlp_norm"),
        {"attn": (("q_proj", "k_proj", "v_proj"), ("o_proj",)), "mlp": (("gate_proj", "up_proj"), ("down_proj",))},
        "norm",
        "lm_head",
    ),
    "hf_llama": Layout(
        "model.embed_tokens",
        "model.layers.*",
        ("input_layernorm", "post_attention_layernorm"),
        {"self_attn": (("q_proj", "k_proj", "v_proj"), ("o_proj",)), "mlp": (("gate_proj", "up_proj"), ("down_proj",))},
        "model.norm",
        "lm_head",
        keyword="hidden_states",
        dtensor_embedding=True,
    ),
    "hf_mixtral": Layout(
        "model.embed_tokens",
        "model.layers.*",
        ("input_layernorm", "post_attention_layernorm"),
        {"self_attn": (("q_proj", "k_proj", "v_proj"), ("o_proj",))},
        "model.norm",
        "lm_head",
        keyword="hidden_states",
        dtensor_embedding=True,
        moe="mlp",
    ),

}
# Qwen3-MoE is Mixtral plus per-head q/k norms after the colwise projections.
LAYOUTS["hf_qwen3_moe"] = dataclasses.replace(LAYOUTS["hf_mixtral"], head_norms=("self_attn.q_norm", "self_attn.k_norm"))


class ExpertsTensorParallel(ParallelStyle):
    """torchtitan's ``TensorParallel`` experts on a Hugging Face experts
    module (3-D ``gate_up_proj``, ``down_proj``): gate|up split per half,
    down by input column; the float inputs enter as ``Replicate`` with
    ``Partial`` gradients; the forward reads the local shards and returns
    this rank's partial sum."""

    _PLACEMENTS = (("gate_up_proj", _StridedShard(1, split_factor=2)), ("down_proj", Shard(2)))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self._PLACEMENTS:
            weight = module._parameters[name]
            assert weight is not None
            module.register_parameter(name, nn.Parameter(distribute_tensor(weight.data, device_mesh, [placement])))

        def partial_grad(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                return DTensor.from_local(a, device_mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))
            return a

        def before(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            for name, _ in self._PLACEMENTS:
                param = m._parameters[name]
                assert isinstance(param, DTensor)
                m.__dict__[name] = param.to_local()
            return tuple(map(partial_grad, args)), {k: partial_grad(v) for k, v in kwargs.items()}

        def after(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            for name, _ in self._PLACEMENTS:
                m.__dict__.pop(name, None)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, always_call=True)
        return module


def _gather(layout: Layout, positional_extras: int) -> PrepareModuleInput:
    if layout.keyword is not None:
        return PrepareModuleInput(
            input_kwarg_layouts={layout.keyword: Shard(1)}, desired_input_kwarg_layouts={layout.keyword: Replicate()}
        )
    return PrepareModuleInput(
        input_layouts=(Shard(1), *(None,) * positional_extras),
        desired_input_layouts=(Replicate(), *(None,) * positional_extras),
    )


def explicit_plan(name: str, *, loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """torchtitan's styles for model ``name`` (a key of :data:`LAYOUTS`), by glob."""
    layout = LAYOUTS[name]
    plan: dict[str, ParallelStyle] = {
        layout.embedding: RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=not layout.dtensor_embedding
        ),
        layout.final_norm: SequenceParallel(),
        layout.head: ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if layout.dtensor_embedding:
        first = layout.blocks.replace("*", "0")
        plan[first] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)
    for norm in layout.norms:
        plan[f"{layout.blocks}.{norm}"] = SequenceParallel()
    if layout.moe is not None:
        plan[f"{layout.blocks}.{layout.moe}"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Partial(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
        plan[f"{layout.blocks}.{layout.moe}.experts"] = ExpertsTensorParallel()
    for norm in layout.head_norms:
        plan[f"{layout.blocks}.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    for region, (colwise, rowwise) in layout.regions.items():
        # titan's attention takes (x, rope): the rope tables stay as they are.
        extras = 1 if name == "titan" and region == "attention" else 0
        plan[f"{layout.blocks}.{region}"] = _gather(layout, extras)
        for proj in colwise:
            plan[f"{layout.blocks}.{region}.{proj}"] = ColwiseParallel()
        for proj in rowwise:
            plan[f"{layout.blocks}.{region}.{proj}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def parallelize_by_hand(
    model: nn.Module,
    name: str,
    mesh: DeviceMesh,
    *,
    loss_parallel: bool = False,
    checkpointing: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """torchtitan's ``apply_tp`` / ``apply_ac`` / ``apply_fsdp`` for ``model``
    on a (dp, tp) mesh: TP with SP, composable ``checkpoint`` per block,
    ``fully_shard`` per block (resharding after forward but the last) and root."""
    parallelize_module(model, mesh["tp"], explicit_plan(name, loss_parallel=loss_parallel))
    container = model.get_submodule(LAYOUTS[name].blocks.removesuffix(".*"))
    blocks = list(container.children())
    if checkpointing:
        for block in blocks:
            checkpoint(block)
    policy = mp_policy or MixedPrecisionPolicy()
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=False)
    return model
