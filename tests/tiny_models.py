"""Tiny random-weight models of every supported family, built from transformers' real config
classes and saved with `save_pretrained`, so the loader meets genuine Hugging Face files."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from fulcrum.config import DEFAULT_MODEL
from fulcrum.utils.tokenizer import copy_tokenizer

COMMON = dict(
    vocab_size=2048,  # the bundled tokenizer's vocabulary, which tiny models reuse
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

# name -> (config class, overrides)
FAMILIES = {
    "llama": (LlamaConfig, dict(tie_word_embeddings=False)),
    "llama3-rope-tied-mqa": (
        LlamaConfig,
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama-bias-headdim": (LlamaConfig, dict(attention_bias=True, mlp_bias=True, head_dim=24)),
    "mistral-sliding": (MistralConfig, dict(sliding_window=8, tie_word_embeddings=False)),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),
}


# Phi-3's LongRoPE rescales each of the head's 8 frequency pairs (head_dim 16) by its own factor
_SHORT = [1.0, 1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0]
_LONG = [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0]
LONGROPE = dict(rope_type="longrope", short_factor=_SHORT, long_factor=_LONG)
_PHI3_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=None)  # Phi3Config's defaults lie beyond 2048

# Mixture-of-experts families: 8 experts, top-2 or top-3, each family's own normalisation of the top-k weights
MOE_FAMILIES = {
    "mixtral": (MixtralConfig, dict(num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
    # a shared expert (wider than a routed one) with its sigmoid gate, weights not renormalised, and a dense layer
    # between two sparse ones (mlp_only_layers)
    "qwen2-moe": (
        Qwen2MoeConfig,
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    # q/k norms and top-3 weights renormalised (norm_topk_prob, true in Qwen3-MoE's releases)
    "qwen3-moe": (
        Qwen3MoeConfig,
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            head_dim=32,
            tie_word_embeddings=False,
        ),
    ),
}

# Families tested in tests/models (logits, engine runs) rather than by the dense families' shared tests: the long
# LongRoPE's prompts must be longer than those tests' shortest (plan's parameter counts take gemma2, gemma3 and
# phi3 too: tests/plan). Their norms get random weights too (transformers
# initialises them to the identity, which would hide a wrong (1 + w)).
MORE_FAMILIES = {
    # layer_types alternate sliding/full; both caps inside the range of the random model's scores and logits, so
    # that they bite
    "gemma2": (
        Gemma2Config,
        dict(
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=1.0,
        ),
    ),
    # a global layer between two sliding ones, each type with its own rope (local base 10k, global 1M linear x4)
    "gemma3": (
        Gemma3TextConfig,
        dict(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            head_dim=32,
            query_pre_attn_scalar=48,
            sliding_window=8,
            rope_scaling=dict(rope_type="linear", factor=4.0),
            rope_local_base_freq=10000.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=False,
        ),
    ),
    "phi3": (Phi3Config, dict(sliding_window=8, **_PHI3_TOKENS)),
    # LongRoPE where the whole context is the original one: the short factors, at every length
    "phi3-longrope": (Phi3Config, dict(rope_scaling=LONGROPE, original_max_position_embeddings=512, **_PHI3_TOKENS)),
    # a context 32x the original (16): the long factors and an attention factor of 1.5; transformers takes these
    # only for sequences longer than 16, so this family's prompts are longer (PROMPT_MIN_LEN)
    "phi3-longrope-long": (
        Phi3Config,
        dict(rope_scaling=LONGROPE, original_max_position_embeddings=16, **_PHI3_TOKENS),
    ),
    # the MoE families too: fulcrum plan's parameter counts are checked for them in tests/models/test_moe.py
    **MOE_FAMILIES,
}
PROMPT_MIN_LEN = {"phi3-longrope-long": 17}  # families whose prompts must be longer than a few tokens


# Multi-head latent attention (DeepSeek-V2/V3), every layer dense (first_k_dense_replace = num_hidden_layers) but
# in the -moe families: a latent of 32 + a RoPE key of 8 per token, heads of 16 + 8 for q/k and 16 for v; YaRN x4
# over an original 128 as the real configs scale (V2's mscale 0.707, V3's 1.0), scaling the softmax as well as cos/sin
_MLA = dict(
    num_key_value_heads=4,  # the config's own field; MLA has no KV heads (transformers wants it = the heads)
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    first_k_dense_replace=2,
    tie_word_embeddings=False,
)

_MLA_MOE = dict(
    num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    n_group=4, topk_group=2,
)  # fmt: skip


def _yarn(mscale: float, mscale_all_dim: float) -> dict:
    return dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32, beta_slow=1,
        mscale=mscale, mscale_all_dim=mscale_all_dim,
    )  # fmt: skip


MLA_FAMILIES = {
    # V2-Lite's shape: no query compression (q_proj), complex-pair RoPE
    "deepseek-v2": (DeepseekV2Config, dict(_MLA, q_lora_rank=None, rope_scaling=_yarn(0.707, 0.707))),
    # V3's: the query through a rank-24 latent with its own norm, interleaved RoPE
    "deepseek-v3": (DeepseekV3Config, dict(_MLA, q_lora_rank=24, rope_scaling=_yarn(1.0, 1.0))),
    # rotate-half RoPE (rope_interleave false), biases on q_a/kv_a/o, and mscales that differ, so YaRN's attention
    # factor on cos and sin is not 1 (1.065) beside the softmax's mscale
    "deepseek-v3-rotate-half": (
        DeepseekV3Config,
        dict(_MLA, q_lora_rank=24, rope_interleave=False, attention_bias=True, rope_scaling=_yarn(1.0, 0.5)),
    ),
    # with experts after one dense layer: 8 routed experts in 4 groups, 2 groups kept, top-3 (V2) or top-2 (V3),
    # shared experts (V2: two, each of moe_intermediate_size; V3: one). V2-236B's router: softmax, group_limited_greedy, scaled;
    # V3's: sigmoid, the score-correction bias (random here, transformers initialises it to zero), groups ranked
    # by their best two, renormalised, scaled by 2.5
    "deepseek-v2-moe": (
        DeepseekV2Config,
        {**_MLA, **_MLA_MOE}
        | dict(
            q_lora_rank=None,
            rope_scaling=_yarn(0.707, 0.707),
            n_shared_experts=2,
            num_experts_per_tok=3,  # top-2 of 2 groups kept would always be greedy's top-2
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
        ),
    ),
    "deepseek-v3-moe": (
        DeepseekV3Config,
        {**_MLA, **_MLA_MOE}
        | dict(
            q_lora_rank=24,
            rope_scaling=_yarn(1.0, 1.0),
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
    ),
}


def make_config(family: str, **overrides):
    cls, extra = FAMILIES[family] if family in FAMILIES else {**MORE_FAMILIES, **MLA_FAMILIES}[family]
    return cls(**{**COMMON, **extra, **overrides})


def save_tiny_model(family: str, folder: Path, seed: int = 0, shard_size: str | None = None, **overrides) -> Path:
    """Random weights (std large enough that logits differ clearly between tokens), saved as HF files.
    `shard_size` (e.g. "40KB") writes a sharded checkpoint with model.safetensors.index.json."""
    torch.manual_seed(seed)
    cfg = make_config(family, **overrides)
    cfg.initializer_range = 0.1
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if family in MORE_FAMILIES or family in MLA_FAMILIES:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") and "gemma" in family:
                    p.normal_(0.0, 0.2)  # the w of Gemma's (1 + w)
                elif name.endswith("norm.weight"):
                    p.uniform_(0.6, 1.4)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: a bias that changes which experts win
                    b.normal_(0.0, 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    kw = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, **kw)
    copy_tokenizer(DEFAULT_MODEL, folder)
    return folder


ST_POOLING = {"last": "lasttoken", "mean": "mean", "cls": "cls"}


def save_tiny_embedding_model(
    folder: Path, pooling: str = "last", normalize: bool = True, family: str = "qwen3", seed: int = 0, **overrides
) -> Path:
    """A sentence-transformers embedding model as Qwen3-Embedding's is laid out: the bare backbone (`Qwen3Model`,
    no "model." prefix, no head) saved by transformers, then sentence-transformers' own save of it with its Pooling
    (and Normalize) modules (modules.json, 1_Pooling/config.json)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling, Transformer
    from transformers import AutoModel

    torch.manual_seed(seed)
    cfg = make_config(family, **overrides)
    cfg.initializer_range = 0.1
    backbone = folder.parent / f"{folder.name}-backbone"
    AutoModel.from_config(cfg, dtype=torch.float32).save_pretrained(backbone)
    copy_tokenizer(DEFAULT_MODEL, backbone)
    # no chat template: sentence-transformers 6 would wrap a text in it (as a "message"), where an embedding model's
    # text is encoded as it is
    (backbone / "chat_template.jinja").unlink(missing_ok=True)
    transformer = Transformer(str(backbone))
    modules = [transformer, Pooling(cfg.hidden_size, ST_POOLING[pooling])]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def hf_model(folder: Path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()


__all__ = [
    "FAMILIES",
    "MORE_FAMILIES",
    "MLA_FAMILIES",
    "MOE_FAMILIES",
    "PROMPT_MIN_LEN",
    "save_tiny_model",
    "save_tiny_embedding_model",
    "hf_model",
    "DEFAULT_MODEL",
]
