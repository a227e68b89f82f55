"""GGUF files of the architectures beyond Llama and Qwen2 (Qwen3, Qwen2-MoE, Qwen3-MoE, Phi-3, Gemma 2, Gemma 3, and
Mistral, which llama.cpp writes as Llama): each written here from a tiny safetensors model as llama.cpp's
convert_hf_to_gguf.py writes it (its metadata keys for the architecture, gguf's tensor names, Gemma's norms as
1 + weight, a layer's experts stacked into one tensor each for gate, up and down), then loaded by fulcrum and held to
the safetensors model's logits, and read back by transformers' own GGUF reader."""

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from fulcrum.config import ModelConfig
from fulcrum.errors import ModelLoadError, UnsupportedArchitectureError
from fulcrum.models.loader import load_model
from tests.models.test_gguf import gguf_cache, permute, write_gpt2_vocab  # noqa: F401  (the fixture)
from tests.models.test_parity import max_diff, our_logits, prompts
from tests.tiny_models import save_tiny_model

# test name -> (tiny_models family, GGUF architecture, overrides that make the model one llama.cpp's file can state)
MODELS = {
    "qwen3": ("qwen3", "qwen3", {}),
    # llama.cpp's Qwen2-MoE has experts in every layer
    "qwen2moe": ("qwen2-moe", "qwen2moe", dict(mlp_only_layers=[])),
    "qwen3moe": ("qwen3-moe", "qwen3moe", {}),
    "phi3": ("phi3", "phi3", {}),
    # llama.cpp's Gemma scales attention by 1/sqrt(head_dim) (1/sqrt(hidden / heads) for the 27Bs), which the file
    # does not state; Gemma 3's layers are five sliding then one global, and its logits are not capped
    "gemma2": ("gemma2", "gemma2", dict(query_pre_attn_scalar=32)),
    "gemma3": (
        "gemma3",
        "gemma3",
        dict(
            num_hidden_layers=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            query_pre_attn_scalar=32,
            final_logit_softcapping=None,
        ),
    ),
    # a Mistral file is a Llama one (the window, which the file cannot state, left out)
    "mistral": ("mistral-sliding", "llama", dict(sliding_window=None)),
}
EXPERT_KINDS = ("gate", "up", "down")


def _metadata(w: gguf.GGUFWriter, arch: str, cfg: dict) -> None:
    """convert_hf_to_gguf.py's set_gguf_parameters for the architecture (TextModel's and the model class's own)."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    rope = rope.get("full_attention", rope)  # Gemma 3's: one per layer type, the file states the global layers'
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "phi3":
        w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    if arch in ("phi3", "gemma2", "gemma3") and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])


def _tensors(arch: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under gguf's names, changed as the converter's modify_tensors changes them."""
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg["num_hidden_layers"])
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = {}
    for layer in range(cfg["num_hidden_layers"]):  # Qwen2MoeModel: each layer's experts stacked, expert e at e
        for kind in EXPERT_KINDS:
            key = f"model.layers.{layer}.mlp.experts.{{}}.{kind}_proj.weight"
            if key.format(0) in tensors:
                stacked = [
                    tensors.pop(key.format(e)) for e in range(cfg.get("num_experts") or cfg["num_local_experts"])
                ]
                out[f"blk.{layer}.ffn_{kind}_exps.weight"] = torch.stack(stacked).numpy()
    for name, t in tensors.items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = permute(t, nh, nh)
        if arch == "llama" and name.endswith("k_proj.weight"):
            t = permute(t, nh, nkv)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1  # Gemma2Model / Gemma3Model: norms as 1 + weight
        if name.endswith("shared_expert_gate.weight"):
            t = t.reshape(-1)  # llama.cpp takes Qwen2-MoE's shared expert gate as a vector of hidden_size
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out[new] = t.float().numpy()
    return out


def write_arch_gguf(folder, out, arch: str, skip=(), extra=None, qtype=None, rounded=False):
    """An F32 GGUF of the model in `folder`, as convert_hf_to_gguf.py writes one for `arch`; `skip` leaves GGUF
    tensors out, `extra` ({GGUF name: array}) adds tensors. `qtype`: every tensor of 2 or more dimensions (experts
    too) in that block type, or with `rounded` in F32 as that type rounds it (the reference)."""
    cfg = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(out, arch)
    w.add_name(folder.name)
    _metadata(w, arch, cfg)
    write_gpt2_vocab(w, folder, cfg)
    tensors = _tensors(arch, cfg, load_file(folder / "model.safetensors")) | (extra or {})
    for name, data in tensors.items():
        if name in skip:
            continue
        data = np.ascontiguousarray(data, np.float32)
        if qtype is not None and data.ndim >= 2 and data.shape[-1] % 32 == 0:
            blocks = gguf.quants.quantize(data, qtype)
            if rounded:
                w.add_tensor(name, np.ascontiguousarray(gguf.quants.dequantize(blocks, qtype), np.float32))
            else:
                w.add_tensor(name, blocks, raw_dtype=qtype)
            continue
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture
def model_and_gguf(tmp_path):
    def make(model, family=None, **kw):
        default_family, arch, overrides = MODELS[model]
        folder = save_tiny_model(family or default_family, tmp_path / model, **overrides)
        return folder, write_arch_gguf(folder, tmp_path / f"{model}-F32.gguf", arch, **kw)

    return make


@pytest.mark.parametrize("model", list(MODELS))
def test_float32_file_gives_the_safetensors_logits(model, model_and_gguf):
    folder, file = model_and_gguf(model)
    config = ModelConfig.from_path(file)
    ours = load_model(config)
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    reference = load_model(ModelConfig.from_path(folder, dtype="float32"))
    assert type(ours) is type(reference) or model == "mistral"  # Mistral's file runs as Llama, the same model
    batch = prompts(2048)  # up to 40 tokens: past the sliding windows (8) of Phi-3's and Gemma's layers
    assert max_diff(our_logits(ours, batch), our_logits(reference, batch)) <= 1e-4


@pytest.mark.parametrize("model", [m for m in MODELS if m != "mistral"])
def test_transformers_reads_the_written_file_back(model, model_and_gguf):
    """transformers' own GGUF reader (its names, its expert stacking, its Gemma norm fix) recovers the model's
    weights from the test's file: the file is written as llama.cpp writes one, not merely as fulcrum reads one."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file = model_and_gguf(model)
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    read = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=hf)["tensors"]
    tied = {"lm_head.weight"} if "output.weight" not in {t.name for t in gguf.GGUFReader(file).tensors} else set()
    assert read.keys() == original.keys() - tied
    for k in read:  # Gemma's norms went through + 1 - 1 in float32
        assert torch.allclose(read[k].reshape(original[k].shape), original[k], rtol=0, atol=1e-6), k


@pytest.mark.parametrize("model", list(MODELS))
def test_quantized_file_gives_the_logits_of_its_rounded_weights(model, tmp_path):
    """Every architecture from a Q8_0 file: its linear layers kept in their blocks (MoE experts dequantized at load),
    the logits those of the same model with its weights rounded as the file rounds them."""
    family, arch, overrides = MODELS[model]
    folder = save_tiny_model(family, tmp_path / model, **overrides)
    file = write_arch_gguf(folder, tmp_path / "q8.gguf", arch, qtype=gguf.GGMLQuantizationType.Q8_0)
    rounded = write_arch_gguf(folder, tmp_path / "rounded.gguf", arch, qtype=gguf.GGMLQuantizationType.Q8_0,
                              rounded=True)  # fmt: skip
    ours = load_model(ModelConfig.from_path(file, dtype="float32"))
    assert any(hasattr(m, "gguf_parts") for m in ours.modules())
    batch = prompts(2048)
    want = our_logits(load_model(ModelConfig.from_path(rounded, dtype="float32")), batch)
    assert max_diff(our_logits(ours, batch), want) <= 1e-4 * max(x.abs().max().item() for x in want)


def test_moe_file_with_a_dense_layer_is_refused(model_and_gguf):
    """llama.cpp's Qwen MoE graphs hold experts in every layer; a file whose layer has no router is not one."""
    _, file = model_and_gguf("qwen3moe", skip={"blk.1.ffn_gate_inp.weight"})
    with pytest.raises(ModelLoadError, match=r"layers \[1\] hold no experts"):
        ModelConfig.from_path(file)


def test_phi3_longrope_file_is_refused(model_and_gguf):
    """Phi-3's LongRoPE factors come as tensors (rope_factors_long/short), which fulcrum does not load from GGUF."""
    factors = np.ones(8, np.float32)  # head_dim 16: one factor per frequency pair
    extra = {"rope_factors_long.weight": factors, "rope_factors_short.weight": factors}
    _, file = model_and_gguf("phi3", family="phi3-longrope", extra=extra)
    with pytest.raises(ModelLoadError, match="LongRoPE"):
        ModelConfig.from_path(file)


def test_unsupported_architecture_lists_the_supported(tmp_path):
    file = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(file, "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    supported = "gemma2, gemma3, llama, phi3, qwen2, qwen2moe, qwen3, qwen3moe"
    with pytest.raises(UnsupportedArchitectureError, match=rf"'phi2'.*supported: {supported}$"):
        ModelConfig.from_path(file)
