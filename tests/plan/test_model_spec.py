"""Parameter counts and KV-cache bytes from config.json, checked against arithmetic done by hand from each
model's published config, and against the parameters of real saved models."""

import json

import pytest
import torch

from fulcrum.errors import ModelLoadError
from fulcrum.plan.model_spec import (
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    load_model_spec,
    parameter_counts,
)
from tests.tiny_models import FAMILIES, hf_model, save_tiny_model


def dense(layers, hidden, heads, kv_heads, head_dim, inter, vocab, tied=False, qkv_bias=False, qk_norm=False):
    """A Llama-style model's parameters, term by term."""
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    attn += (heads + 2 * kv_heads) * head_dim * qkv_bias + 2 * head_dim * qk_norm
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + hidden + vocab * hidden * (1 if tied else 2)


@pytest.mark.parametrize(
    "preset, params, published, kv_per_token",
    [
        # Llama 3.1 8B: 32 layers, hidden 4096, 32 heads / 8 KV heads of 128, MLP 14336, vocab 128256
        ("llama-3.1-8b", dense(32, 4096, 32, 8, 128, 14336, 128256), 8.03e9, 2 * 32 * 8 * 128 * 2),
        ("llama-3.1-70b", dense(80, 8192, 64, 8, 128, 28672, 128256), 70.6e9, 2 * 80 * 8 * 128 * 2),
        ("llama-3.1-405b", dense(126, 16384, 128, 8, 128, 53248, 128256), 405.9e9, 2 * 126 * 8 * 128 * 2),
        # Qwen2.5 7B: q/k/v biases, 28 heads / 4 KV heads of 3584/28 = 128
        ("qwen2.5-7b", dense(28, 3584, 28, 4, 128, 18944, 152064, qkv_bias=True), 7.62e9, 2 * 28 * 4 * 128 * 2),
        # Qwen3: q/k RMSNorm; 32B has head_dim 128 although 5120 / 64 heads = 80
        ("qwen3-8b", dense(36, 4096, 32, 8, 128, 12288, 151936, qk_norm=True), 8.19e9, 2 * 36 * 8 * 128 * 2),
        ("qwen3-32b", dense(64, 5120, 64, 8, 128, 25600, 151936, qk_norm=True), 32.8e9, 2 * 64 * 8 * 128 * 2),
    ],
)
def test_dense_presets_match_hand_counts(preset, params, published, kv_per_token):
    spec = load_model_spec(preset)
    p = parameter_counts(spec)
    assert p.total == p.active == params
    assert p.total == pytest.approx(published, rel=0.005)  # the size the model card states
    assert kv_bytes_per_token(spec, "bf16") == kv_per_token
    # fp8: one byte a value, and fulcrum's fp16 scale per token, layer and KV head
    scales = 2 * spec.num_layers * spec.num_kv_heads * 2
    assert kv_bytes_per_token(spec, "fp8") == kv_per_token / 2 + scales


def test_qwen3_32b_reports_its_explicit_head_dim():
    assert any("explicit head_dim 128" in d for d in load_model_spec("qwen3-32b").details())


def test_mixtral_total_and_active():
    h, layers, inter, vocab = 4096, 32, 14336, 32000
    attn = h * 4096 + 2 * h * 1024 + 4096 * h
    common = layers * (attn + 2 * h + h * 8) + h + 2 * vocab * h  # router: hidden x 8 experts
    expert = 3 * h * inter
    p = parameter_counts(load_model_spec("mixtral-8x7b"))
    assert p.total == common + layers * 8 * expert
    assert p.active == common + layers * 2 * expert
    assert p.total == pytest.approx(46.7e9, rel=0.005) and p.active == pytest.approx(12.9e9, rel=0.005)


def test_deepseek_v3_mla_and_moe():
    spec = load_model_spec("deepseek-v3")
    h, heads, layers = 7168, 128, 61
    attn = (h * 1536 + 1536 + 1536 * heads * (128 + 64)) + (h * (512 + 64) + 512 + 512 * heads * (128 + 128))
    attn += heads * 128 * h
    dense_mlp, expert = 3 * h * 18432, 3 * h * 2048
    router = h * 256 + 256
    base = layers * (attn + 2 * h) + h + 2 * 129280 * h + 3 * dense_mlp
    p = parameter_counts(spec)
    assert p.total == base + 58 * (router + 257 * expert)  # 256 routed + 1 shared
    assert p.active == base + 58 * (router + 9 * expert)  # 8 routed + 1 shared
    assert p.total == pytest.approx(671e9, rel=0.002)
    assert p.active == pytest.approx(37e9, rel=0.02)
    # MLA caches one latent (kv_lora_rank) and one RoPE key per token and layer, whatever the head count
    assert kv_bytes_per_token(spec, "bf16") == (512 + 64) * 61 * 2 == 70272
    assert "MLA" in spec.details()[0]


def test_gpt_oss_sliding_layers_keep_only_their_window():
    spec = load_model_spec("gpt-oss-120b")
    per_layer_token = 2 * 8 * 64 * 2
    assert kv_bytes_per_token(spec) == 36 * per_layer_token
    # 18 full-attention layers hold all 32768 tokens; 18 sliding layers hold 128
    assert kv_bytes_per_sequence(spec, 32768) == per_layer_token * (18 * 32768 + 18 * 128)
    p = parameter_counts(spec)
    assert p.total == pytest.approx(116.83e9, rel=0.002)
    # OpenAI's 5.13B active excludes the embedding table (a lookup, not a matmul)
    assert p.active - p.embedding == pytest.approx(5.13e9, rel=0.01)


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["gemma2", "gemma3", "phi3"])
def test_local_folder_counts_equal_the_saved_models_parameters(family, tmp_path):
    folder = save_tiny_model(family, tmp_path / family)
    model = hf_model(folder, dtype=torch.float32)
    spec = load_model_spec(folder)
    assert parameter_counts(spec).total == sum(t.numel() for t in model.parameters())
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert kv_bytes_per_token(spec, "fp32") == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * 4


def test_bare_config_json_and_errors(tmp_path):
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
    path = tmp_path / "my-config.json"
    path.write_text(json.dumps({**cfg, "vocab_size": 100, "num_key_value_heads": 1}))
    spec = load_model_spec(path)
    assert spec.name == "my-config" and "MQA" in spec.attention_kind
    assert kv_bytes_per_token(spec) == 2 * 2 * 1 * 16 * 2
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_spec(tmp_path)  # a folder without config.json
    with pytest.raises(ModelLoadError, match="llama-3.1-8b"):
        load_model_spec("no-such-model")  # names the presets
