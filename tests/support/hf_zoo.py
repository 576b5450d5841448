"""Tiny Hugging Face models built from their config classes (no hub access).

Every builder takes ``device`` (``"meta"`` to plan, ``"cpu"`` to run) and
``dtype`` (the storage dtype of the bulk: bf16 as shipped, fp32 for master
weights). Sizes: 2 layers, hidden 64, vocab 128; head counts, kv heads,
intermediate sizes and vocab are divisible by 2 and 4, so TP sizes 2 and 4
divide every sharded dim. Each builder's docstring says which parameters are
fp32 holders and which module they sit on directly.

All models forward on CPU in fp32 with transformers' pure-torch fallbacks
(no mamba_ssm, causal_conv1d or fla kernels needed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fsdptx.hf import build_hf_model

Builder = Callable[..., nn.Module]

VOCAB = 128
HIDDEN = 64
LAYERS = 2
# Training recipes keep SSM / gated-delta decay parameters and attention sinks
# in fp32 although the shipped checkpoints store them in bf16.
SSM_FP32 = ("mixer.A_log", "mixer.D", "mixer.dt_bias")

_DENSE = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=64,
)


def llama(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Llama: no fp32 holders. With ``dtype=torch.float32`` every weight is an
    fp32 master weight that should compute in the policy's dtype."""
    return build_hf_model("llama", _DENSE, dtype=dtype, device=device)


def qwen3_tied(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Qwen3 with ``lm_head.weight`` tied to ``model.embed_tokens.weight``; per-head
    ``q_norm``/``k_norm`` are TP ``replicated_with_grad_allreduce``. No fp32 holders."""
    return build_hf_model("qwen3", {**_DENSE, "tie_word_embeddings": True}, dtype=dtype, device=device)


def olmo2(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Olmo2: its TP plan gathers the outputs of q/k/v (``colwise_gather_output``,
    for q/k norms over all heads) and splits o_proj's input
    (``rowwise_split_input``). No fp32 holders. Not in :data:`ZOO`: the
    sequence-parallel parity test uses it for that plan."""
    overrides = {**_DENSE, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    return build_hf_model("olmo2", overrides, dtype=dtype, device=device)


DEEPSEEK_V3: dict[str, object] = {
    **_DENSE,
    "head_dim": 8,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}
"""DeepSeek-V3's tiny config: MLA attention, layer 0 dense, then MoEs of 4
routed experts (top-2) and a shared expert."""


def deepseek_v3(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """DeepSeek-V3: MLA attention (low-rank q and kv projections, which its
    TP plan leaves alone), layer 0 a dense MLP, layer 1 an MoE of 4 routed
    experts (top-2) and a shared expert. Not in :data:`ZOO`: the
    sequence-parallel tests use it for a plan that covers the MLPs only."""
    return build_hf_model("deepseek_v3", DEEPSEEK_V3, dtype=dtype, device=device)


def jamba(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Jamba, a hybrid: layer 0 a Mamba mixer with a dense MLP, layer 1
    attention with an MoE of 4 experts; its TP plan names only the experts
    (``moe_tp_experts``), so no other module is tensor-parallel. Not in :data:`ZOO`."""
    overrides = {
        **_DENSE,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
    }
    return build_hf_model("jamba", overrides, dtype=dtype, device=device)


def qwen3_moe(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Qwen3-MoE, 4 experts (top-2) of width 32 fused in ``mlp.experts``
    (3-D ``gate_up_proj``/``down_proj``) beside the ``mlp.gate`` router. No fp32 holders."""
    overrides = {**_DENSE, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
    return build_hf_model("qwen3_moe", overrides, dtype=dtype, device=device)


def mixtral(device: str = "meta", dtype: torch.dtype = torch.bfloat16, keep_in_fp32: tuple[str, ...] = ()) -> nn.Module:
    """Mixtral, 4 experts (top-2) of width 128 fused in ``mlp.experts`` beside
    the ``mlp.gate`` router (a module holding its weight directly). No fp32
    holders as shipped; ``keep_in_fp32=("mlp.gate.",)`` keeps the router fp32."""
    overrides = {**_DENSE, "num_local_experts": 4, "num_experts_per_tok": 2}
    return build_hf_model("mixtral", overrides, dtype=dtype, device=device, keep_in_fp32=keep_in_fp32)


def qwen2_moe(device: str = "meta", dtype: torch.dtype = torch.bfloat16, keep_in_fp32: tuple[str, ...] = ()) -> nn.Module:
    """Qwen2-MoE, 4 experts (top-2) of width 32 in ``mlp.experts`` beside the
    ``mlp.gate`` router, a shared expert (``mlp.shared_expert``) and its
    one-output ``mlp.shared_expert_gate``."""
    overrides = {
        **_DENSE,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    }
    return build_hf_model("qwen2_moe", overrides, dtype=dtype, device=device, keep_in_fp32=keep_in_fp32)


def olmoe(device: str = "meta", dtype: torch.dtype = torch.bfloat16, keep_in_fp32: tuple[str, ...] = ()) -> nn.Module:
    """OLMoE, 4 experts (top-2) of width 128 in ``mlp.experts`` beside the
    ``mlp.gate`` router; q/k norms over all heads."""
    overrides = {**_DENSE, "num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 0, "eos_token_id": 2}
    return build_hf_model("olmoe", overrides, dtype=dtype, device=device, keep_in_fp32=keep_in_fp32)


def gpt_oss(device: str = "meta", dtype: torch.dtype = torch.bfloat16, layers: int = LAYERS) -> nn.Module:
    """GPT-OSS, 4 experts: fp32 ``sinks`` (one per head) directly on every
    ``model.layers.*.self_attn`` beside its bf16 ``q/k/v/o_proj`` children.
    As shipped the sinks are bf16 (only ``_keep_in_fp32_modules`` norms, for
    fp16 loads); training keeps them fp32. Sliding and full attention
    layers alternate."""
    overrides = {
        **_DENSE,
        "num_hidden_layers": layers,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
    }
    return build_hf_model("gpt_oss", overrides, dtype=dtype, device=device, keep_in_fp32=("sinks",))


def qwen3_next(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Qwen3-Next: layer 0 gated delta-net, layer 1 full attention, MoE MLPs.
    fp32 ``A_log`` and ``dt_bias`` sit directly on ``model.layers.0.linear_attn``
    beside bf16 ``in_proj_qkvz``/``in_proj_ba``/``conv1d``/``norm``/``out_proj``
    children (fp32 as training keeps them; bf16 as shipped)."""
    overrides = {
        **_DENSE,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    return build_hf_model("qwen3_next", overrides, dtype=dtype, device=device, keep_in_fp32=("A_log", "dt_bias"))


def mamba2(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Mamba2: fp32 ``A_log``, ``D``, ``dt_bias`` directly on every
    ``backbone.layers.*.mixer`` beside bf16 ``in_proj``/``conv1d``/``norm``/
    ``out_proj`` children (fp32 as training keeps them; bf16 as shipped)."""
    overrides = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_heads=8,
        head_dim=16,
        state_size=16,
        n_groups=2,
        expand=2,
        chunk_size=16,
    )
    return build_hf_model("mamba2", overrides, dtype=dtype, device=device, keep_in_fp32=SSM_FP32)


def nemotron_h(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """NemotronH, layers mamba / attention / MoE: fp32 ``A_log``, ``D``, ``dt_bias``
    directly on ``model.layers.0.mixer`` (training; bf16 as shipped), and the
    MoE router weight ``model.layers.2.mixer.gate.weight`` fp32 as shipped
    (``_keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight"]``;
    the bias is an fp32 buffer)."""
    overrides = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        layers_block_type=["mamba", "attention", "moe"],
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=128,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
    )
    return build_hf_model("nemotron_h", overrides, dtype=dtype, device=device, keep_in_fp32=SSM_FP32)


def gemma3_multimodal(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Gemma3ForConditionalGeneration with a 1-layer SigLIP vision tower; the
    text ``lm_head.weight`` is tied to ``model.language_model.embed_tokens.weight``.
    No fp32 holders."""
    text = {**_DENSE, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    overrides = dict(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1)
    return build_hf_model("gemma3", overrides, dtype=dtype, device=device)


def kimi_linear(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Kimi-Linear: layer 0 KDA linear attention, layer 1 MLA full attention.
    As shipped, ``model.layers.0.self_attn.forget_gate`` holds fp32 ``dt_bias``
    (created fp32, and strict-fp32) beside bf16 ``A_log`` directly on the same
    module, with bf16 ``f_a_proj``/``f_b_proj`` children: its direct parameters
    mix storage dtypes, which no FSDP unit can hold. The MoE router
    ``gate.weight`` is strict fp32."""
    overrides = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        linear_head_dim=16,
        linear_num_heads=4,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return build_hf_model("kimi_linear", overrides, dtype=dtype, device=device)


ZOO: dict[str, Builder] = {
    "llama": llama,
    "qwen3_tied": qwen3_tied,
    "qwen3_moe": qwen3_moe,
    "gpt_oss": gpt_oss,
    "qwen3_next": qwen3_next,
    "mamba2": mamba2,
    "nemotron_h": nemotron_h,
    "gemma3_multimodal": gemma3_multimodal,
    "kimi_linear": kimi_linear,
}
