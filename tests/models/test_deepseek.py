"""DeepSeek-V2/V3 (multi-head latent attention, dense and with their mixture of experts) against transformers on tiny
random models of their real config classes: fp32 logits, the engine's greedy tokens and logprobs however a request
runs (in tests/models/test_parity.py with the other families), the KV bytes the engine allocates per token against `fulcrum plan`'s figure, every block freed, the routers'
settings, and what fulcrum refuses."""

import pytest
import torch
from safetensors.torch import load_file

from fulcrum import LLM
from fulcrum.config import ModelConfig
from fulcrum.errors import InvalidRequestError
from fulcrum.layers.mla import MLAAttention
from fulcrum.models.loader import load_model
from fulcrum.plan.model_spec import kv_bytes_per_token, load_model_spec
from fulcrum.quant import formats
from tests.engine.test_llm_parity import make_llm
from tests.models.test_parity import hf_logits, max_diff, our_logits, prompts
from tests.tiny_models import MLA_FAMILIES, hf_model, save_tiny_model

LENS = [1, 5, 17, 40, 130]  # 130 is past YaRN's original context (128)
FAMILIES = list(MLA_FAMILIES)


def _load(folder, dtype="float32"):
    return load_model(ModelConfig.from_path(folder, dtype=dtype))


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_match_transformers(family, tiny_model_dir):
    folder = tiny_model_dir(family)
    batch = prompts(2048, lens=LENS)
    assert max_diff(our_logits(_load(folder), batch), hf_logits(hf_model(folder), batch)) <= 1e-4


def test_bfloat16_logits_close_to_transformers(tiny_model_dir):
    """bf16 rounds each side's activations in its own order (the latent up-projection batched per head here, one
    GEMM there): within 3% of the largest logit, the bound the dense families' bf16 test takes."""
    folder = tiny_model_dir("deepseek-v3")
    batch = prompts(2048, lens=LENS)
    ref32 = hf_logits(hf_model(folder), batch)
    diff = max_diff(our_logits(_load(folder, "bfloat16"), batch), hf_logits(hf_model(folder, torch.bfloat16), batch))
    assert diff <= 0.03 * max(x.abs().max().item() for x in ref32)


@pytest.mark.parametrize("family", ["deepseek-v2", "deepseek-v3", "deepseek-v3-moe"])
def test_int8_weights_match_transformers_with_the_same_rounded_weights(family, tiny_model_dir):
    """Online int8 quantizes kv_b_proj too: W_UK and W_UV are read back from the quantized layer, so the logits
    equal transformers' with every linear weight rounded as int8 rounds it (the routed experts and the router are
    not linear layers on either side, and stay in full precision)."""
    folder = tiny_model_dir(family)
    theirs = hf_model(folder)
    with torch.no_grad():
        for module in theirs.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(formats.dequantize_int8(*formats.quantize_int8(module.weight)))
    ours = load_model(ModelConfig.from_path(folder, dtype="float32", quantization="int8"))
    batch = prompts(2048, lens=LENS)
    assert max_diff(our_logits(ours, batch), hf_logits(theirs, batch)) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_scale_and_rope_are_transformers(family, tiny_model_dir):
    """YaRN's mscale on the softmax scale (1.30x for V3's mscale_all_dim 1.0 at factor 4), the rope table of the
    qk_rope_head_dim part with YaRN's attention factor on cos and sin, and each family's RoPE layout."""
    folder = tiny_model_dir(family)
    ours, theirs = _load(folder), hf_model(folder)
    attn = ours.model.layers[0].self_attn
    assert attn.attn.scale == pytest.approx(theirs.model.layers[0].self_attn.scaling, rel=1e-12)
    assert attn.attn.scale > 1.1 * (16 + 8) ** -0.5
    assert attn.interleaved == (family != "deepseek-v3-rotate-half")
    rotary = theirs.model.rotary_emb
    assert ours.model.rotary_emb.cos.shape[-1] == 8
    assert ours.model.rotary_emb.cos[0, 0].item() == pytest.approx(rotary.attention_scaling)


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3-rotate-half"])
def test_the_rope_layout_shows_in_the_logits(family, tiny_model_dir, tmp_path):
    """The same weights read with V3's other RoPE layout move transformers' logits far past the parity tolerance,
    so the parity test's agreement is the layout honoured (V2 has one layout, complex pairs)."""
    folder = tiny_model_dir(family)
    other = save_tiny_model(
        family, tmp_path / "other", rope_interleave=not MLA_FAMILIES[family][1].get("rope_interleave", True)
    )
    batch = prompts(2048, lens=LENS[1:])
    assert max_diff(hf_logits(hf_model(folder), batch), hf_logits(hf_model(other), batch)) > 1e-2


@pytest.mark.parametrize("dtype, plan_dtype", [("float32", "fp32"), ("bfloat16", "bf16")])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_cache_holds_the_latent_and_rope_key_only_as_plan_counts(family, dtype, plan_dtype, tiny_model_dir):
    """KV bytes per token the engine allocates = `fulcrum plan`'s MLA figure for the same config.json:
    (kv_lora_rank + qk_rope_head_dim) values per layer, 40 here (a GQA cache would hold 2 x heads x head_dim per
    layer); the allocated tensor is exactly num_blocks of them."""
    folder = tiny_model_dir(family)
    llm = LLM(model=str(folder), dtype=dtype, seed=0, kv_cache_memory=16 << 20)
    runner = llm.core.runner
    per_token = kv_bytes_per_token(load_model_spec(folder), plan_dtype)
    assert runner.bytes_per_block == runner.block_size * per_token
    assert all(isinstance(a, MLAAttention) for a in runner.attn_layers)
    layers, size = runner.model.config.num_hidden_layers, getattr(torch, dtype).itemsize
    assert runner.bytes_per_block == runner.block_size * layers * (32 + 8) * size
    cache = runner.kv_cache
    assert cache.shape == (layers, runner.num_blocks, runner.block_size, 40)
    assert cache.numel() * cache.element_size() == runner.num_blocks * runner.bytes_per_block
    assert runner.kv_scales is None


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_a_quantized_kv_cache_is_refused_by_name(kv_cache_dtype, tiny_model_dir):
    with pytest.raises(InvalidRequestError, match=f"--kv-cache-dtype {kv_cache_dtype}.*latent") as e:
        make_llm(tiny_model_dir("deepseek-v3"), kv_cache_dtype=kv_cache_dtype)
    assert e.value.param == "kv_cache_dtype"


def _hf_routers(model):
    return [m for m in model.modules() if type(m).__name__ in ("DeepseekV2TopkRouter", "DeepseekV3TopkRouter")]


@pytest.mark.parametrize("family", ["deepseek-v2-moe", "deepseek-v3-moe"])
def test_the_router_settings_show_in_the_logits(family, tiny_model_dir):
    """Lifting the group limit (every group kept) and, for V3, zeroing the score-correction bias each move
    transformers' logits far past the parity tolerance, so the parity tests' agreement is grouped top-k and the
    bias honoured."""
    folder = tiny_model_dir(family)
    batch = prompts(2048, lens=LENS[1:])
    ref = hf_logits(hf_model(folder), batch)
    ungrouped = hf_model(folder)
    for router in _hf_routers(ungrouped):
        router.topk_group = router.num_group
    assert max_diff(hf_logits(ungrouped, batch), ref) > 1e-2
    if family == "deepseek-v3-moe":
        unbiased = hf_model(folder)
        for router in _hf_routers(unbiased):
            router.e_score_correction_bias.zero_()
        assert max_diff(hf_logits(unbiased, batch), ref) > 1e-2


def test_v2_greedy_routing_matches_transformers(tmp_path):
    """DeepSeek-V2-Lite's router: the top-k of all experts, no groups."""
    folder = save_tiny_model("deepseek-v2-moe", tmp_path / "m", topk_method="greedy")
    batch = prompts(2048, lens=LENS)
    assert max_diff(our_logits(_load(folder), batch), hf_logits(hf_model(folder), batch)) <= 1e-4


@pytest.mark.parametrize("family", ["deepseek-v2-moe", "deepseek-v3-moe"])
def test_experts_shared_experts_and_router_load_as_the_checkpoint_has_them(family, tiny_model_dir):
    """Each expert's gate/up/down stacked in order, the shared experts as one MLP of their summed width, the
    router's weight (and V3's correction bias) in float32, the first layer dense."""
    folder = tiny_model_dir(family)
    tensors = load_file(folder / "model.safetensors")
    ours = _load(folder)
    assert not hasattr(ours.model.layers[0].mlp, "experts")
    moe = ours.model.layers[1].mlp
    for e in range(8):
        gate, up = (tensors[f"model.layers.1.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj"))
        assert torch.equal(moe.experts.gate_up_proj.weight[e], torch.cat([gate, up]))
        assert torch.equal(moe.experts.down_proj.weight[e], tensors[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])
    shared = tensors["model.layers.1.mlp.shared_experts.down_proj.weight"]
    assert torch.equal(moe.shared_experts.down_proj.weight, shared)
    assert shared.shape[1] == 32 * ours.config.n_shared_experts
    assert moe.gate.weight.dtype == torch.float32
    assert torch.equal(moe.gate.weight, tensors["model.layers.1.mlp.gate.weight"])
    if family == "deepseek-v3-moe":
        bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.abs().max() > 0.1 and torch.equal(moe.gate.e_score_correction_bias, bias)
