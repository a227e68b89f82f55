"""gpt-oss: a tiny random GptOssForCausalLM (transformers' own classes, real config fields: alternating sliding and
full layers with a window the prompts pass, non-zero sinks, YaRN rope, biases everywhere) whose experts are saved as
the release stores them, MXFP4 `*_blocks`/`*_scales` with quantization_config mxfp4. fulcrum keeps them in MXFP4;
its logits and greedy tokens must be transformers' on the dequantized experts (eager attention)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig

from fulcrum.config import ModelConfig
from fulcrum.models.gpt_oss import GptOssExperts
from fulcrum.models.loader import load_model
from fulcrum.quant import mxfp4
from fulcrum.utils.tokenizer import copy_tokenizer
from tests.engine.test_llm_parity import greedy, make_llm
from tests.models.test_parity import hf_logits, max_diff, our_logits, prompts
from tests.tiny_models import DEFAULT_MODEL

WINDOW = 8
PROJS = ("gate_up_proj", "down_proj")


def tiny_config(**overrides) -> GptOssConfig:
    cfg = dict(
        vocab_size=2048, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=128, rope_theta=150000.0),
        architectures=["GptOssForCausalLM"],
    )  # fmt: skip
    return GptOssConfig(**{**cfg, **overrides})


def save_tiny_gpt_oss(folder, seed: int = 0, quantize: bool = True, **overrides):
    """The model saved by transformers; with `quantize` its experts rewritten as MXFP4 blocks and scales (each
    [E, out, in] weight quantized; transformers keeps them [E, in, out]). Returns the folder and the transformers
    model whose experts are the dequantized MXFP4 weights (exactly what the file holds)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(**overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.6, 1.4)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, 0.1)
        if quantize:  # the reference computes with what MXFP4 keeps of the weights
            for layer in model.model.layers:
                for proj in PROJS:
                    w = getattr(layer.mlp.experts, proj)
                    w.copy_(mxfp4.dequantize(*mxfp4.quantize(w.transpose(1, 2))).transpose(1, 2))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    copy_tokenizer(DEFAULT_MODEL, folder)
    if quantize:
        file = folder / "model.safetensors"
        tensors = load_file(file)
        for name in [n for n in tensors if n.endswith(PROJS)]:
            blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        save_file(tensors, file, metadata={"format": "pt"})
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                       "lm_head"],
        }  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder, model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "m")


def test_the_experts_load_and_stay_mxfp4(tiny):
    folder, _ = tiny
    tensors = load_file(folder / "model.safetensors")
    experts = load_model(ModelConfig.from_path(folder, dtype="float32")).model.layers[0].mlp.experts
    assert isinstance(experts, GptOssExperts) and experts.quantized
    for proj in PROJS:
        blocks = getattr(experts, f"{proj}_blocks")
        assert blocks.dtype == torch.uint8
        assert torch.equal(blocks, tensors[f"model.layers.0.mlp.experts.{proj}_blocks"])
    assert not hasattr(experts, "gate_up_proj")  # no dense copy kept


def test_float32_logits_match_transformers_on_the_dequantized_experts(tiny):
    """Prompts up to 40 tokens: past the sliding window (8) of the first layer, with the sinks in every softmax."""
    folder, theirs = tiny
    ours = load_model(ModelConfig.from_path(folder, dtype="float32"))
    batch = prompts(ours.config.vocab_size, lens=[1, 5, 17, 40])
    assert max_diff(our_logits(ours, batch), hf_logits(theirs, batch)) <= 1e-4


def test_the_sinks_and_the_window_show_in_the_logits(tmp_path, tiny):
    """Zeroing the sinks, or widening the window, changes the logits: the parity above depends on both."""
    folder, theirs = tiny
    batch = prompts(2048, lens=[40])
    ref = hf_logits(theirs, batch)
    ours = load_model(ModelConfig.from_path(folder, dtype="float32"))
    for layer in ours.model.layers:
        layer.self_attn.sinks.data.zero_()
    assert max_diff(our_logits(ours, batch), ref) > 1e-2
    ours = load_model(ModelConfig.from_path(folder, dtype="float32"))
    ours.model.layers[0].self_attn.attn.sliding_window = None
    assert max_diff(our_logits(ours, batch), ref) > 1e-2


def test_greedy_tokens_through_the_engine_match_transformers(tiny):
    """The paged cache, prefill and decode (a sink in each decode's softmax): greedy tokens as transformers'."""
    folder, theirs = tiny
    llm = make_llm(folder)
    batch = prompts(2048, seed=3, lens=[6, 30])
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(max_tokens=12))
    for p, out in zip(batch, outs):
        with torch.no_grad():
            ref = theirs.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert out.outputs[0].token_ids == ref[0, len(p) :].tolist()


def test_bf16_logits_close_to_transformers(tiny):
    """bf16 activations over the same MXFP4 experts (the kernel's bf16 path): close to the fp32 reference."""
    folder, theirs = tiny
    ours = load_model(ModelConfig.from_path(folder, dtype="bfloat16"))
    batch = prompts(2048, lens=[5, 40])
    ref = hf_logits(theirs, batch)
    got = our_logits(ours, batch)
    assert max_diff(got, ref) <= 0.03 * max(r.abs().max().item() for r in ref)  # bf16 rounding: 1.5% measured


def test_a_dense_checkpoint_loads_too(tmp_path):
    folder, theirs = save_tiny_gpt_oss(tmp_path / "dense", quantize=False)
    ours = load_model(ModelConfig.from_path(folder, dtype="float32"))
    assert not ours.model.layers[0].mlp.experts.quantized
    batch = prompts(2048, lens=[3, 20])
    assert max_diff(our_logits(ours, batch), hf_logits(theirs, batch)) <= 1e-4


def test_plan_counts_the_bytes_the_engine_holds(tiny):
    """`fulcrum plan`'s resident weight bytes for the MXFP4 checkpoint (experts at 4.25 bits: the values and one
    exponent per 32, the rest bf16) equal what the engine holds at bf16; and batch-1 decode reads the top-k experts'
    share of them."""
    from fulcrum.plan.model_spec import load_model_spec
    from fulcrum.plan.roofline import resident_weight_bytes, weight_bytes_read

    folder, _ = tiny
    ours = load_model(ModelConfig.from_path(folder, dtype="bfloat16"))
    held = sum(p.numel() * p.element_size() for p in ours.parameters())
    spec = load_model_spec(folder)
    assert spec.expert_format == "mxfp4"
    assert resident_weight_bytes(spec, "bf16") == held
    experts = ours.model.layers[0].mlp.experts
    names = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
             "down_proj_scales", "down_proj_bias")  # fmt: skip
    per_expert = sum(getattr(experts, n)[0].numel() * getattr(experts, n).element_size() for n in names)
    unread = spec.moe.num_experts * (1 - spec.moe.experts_per_token / spec.moe.num_experts)
    embedding = ours.model.embed_tokens.weight
    want = held - embedding.numel() * embedding.element_size() - unread * per_expert * spec.num_layers
    assert weight_bytes_read(spec, "bf16", 1) == pytest.approx(want)
