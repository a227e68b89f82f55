"""Phi-3 beyond the shared parity tests (tests/models/test_parity.py): its fused checkpoint tensors, split per shard
as tensor parallelism needs, their errors, and which LongRoPE factors a sequence gets."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import fulcrum.layers.linear as linear
from fulcrum.config import ModelConfig
from fulcrum.errors import WeightLoadError
from fulcrum.models.loader import load_model
from fulcrum.models.phi3 import load_fused
from tests.models.test_parity import hf_logits, max_diff, our_logits, prompts
from tests.tiny_models import hf_model, save_tiny_model


def _load(folder):
    return load_model(ModelConfig.from_path(folder, dtype="float32"))


def test_the_checkpoint_holds_fused_tensors_and_they_load_as_they_are(tmp_path):
    folder = save_tiny_model("phi3", tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" in tensors and "model.layers.0.mlp.gate_up_proj.weight" in tensors
    assert not any("q_proj" in name or "gate_proj" in name for name in tensors)
    layer = _load(folder).model.layers[0]
    assert torch.equal(layer.self_attn.qkv_proj.weight, tensors["model.layers.0.self_attn.qkv_proj.weight"])
    assert torch.equal(layer.mlp.gate_up_proj.weight, tensors["model.layers.0.mlp.gate_up_proj.weight"])


def test_a_fused_tensor_is_split_per_shard_for_each_tensor_parallel_rank(monkeypatch):
    """Rank 1 of 2 takes the second half of q, of k and of v, not the second half of the fused rows."""
    monkeypatch.setattr(linear, "tp_size", lambda: 2)
    monkeypatch.setattr(linear, "tp_rank", lambda: 1)
    hd, heads, kv_heads, hidden = 4, 4, 2, 8
    qkv = linear.QKVParallelLinear(hidden, hd, heads, kv_heads, dtype=torch.float32)
    load_fused(qkv, ["q", "k", "v"], [heads * hd, kv_heads * hd, kv_heads * hd])
    fused = torch.arange((heads + 2 * kv_heads) * hd * hidden, dtype=torch.float32).view(-1, hidden)
    q, k, v = fused.split([heads * hd, kv_heads * hd, kv_heads * hd])
    qkv.weight.weight_loader(qkv.weight, fused)
    assert torch.equal(qkv.weight, torch.cat([q[heads * hd // 2 :], k[kv_heads * hd // 2 :], v[kv_heads * hd // 2 :]]))


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path):
    folder = save_tiny_model("phi3", tmp_path / "m")
    file = folder / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.mlp.gate_up_proj.weight"
    tensors[name] = tensors[name][:-2]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=rf"{name}: checkpoint shape \(254, 64\), model expects \(256, 64\)"):
        _load(folder)


def test_longrope_long_factors_serve_every_sequence_when_the_context_exceeds_the_original(tmp_path):
    """phi3-longrope-long: a context of 512 against an original 16. transformers takes the long factors only for a
    forward call over more than 16 positions; fulcrum takes them for every sequence (one rotation per position for
    a paged, shared cache, as vLLM), so a short prompt equals transformers made to take them too, and differs
    from transformers left to itself."""
    folder = save_tiny_model("phi3-longrope-long", tmp_path / "m")
    ours = _load(folder)
    theirs = hf_model(folder)
    batch = prompts(2048, lens=[3, 9, 16])
    as_is = hf_logits(theirs, batch)
    rotary = theirs.model.rotary_emb
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](theirs.config, seq_len=17)
    rotary.original_inv_freq = long_inv_freq  # the frequencies its short calls fall back to
    assert max_diff(our_logits(ours, batch), hf_logits(theirs, batch)) <= 1e-4
    assert max_diff(our_logits(ours, batch[1:]), as_is[1:]) > 1e-2
