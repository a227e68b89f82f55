"""`quantization=int8|int4`: a full-precision checkpoint is quantized at load time. Its logits stay within a stated
tolerance of the same model with the dequantized weights written as an ordinary checkpoint (the reference), its
greedy tokens through the engine equal transformers' on that reference, and its weights take the bytes the format
says."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from fulcrum import LLM, SamplingParams
from fulcrum.config import ModelConfig
from fulcrum.errors import InvalidRequestError, ModelLoadError
from fulcrum.layers.attention import AttentionMetadata
from fulcrum.models.loader import load_model
from fulcrum.quant import formats
from tests.engine.hf_reference import hf_greedy
from tests.tiny_models import save_tiny_model

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
METHODS = {
    "int8": {},
    "fp8": {},
    "int4-g32": {"quantization_group_size": 32},
    "int4-g64": {"quantization_group_size": 64},
}


def dequantized(w: torch.Tensor, method: str, group: int) -> torch.Tensor:
    if method in ("int8", "fp8"):
        return getattr(formats, f"dequantize_{method}")(*getattr(formats, f"quantize_{method}")(w))
    return formats.dequantize_int4(*formats.quantize_int4(w, group))


def write_reference(src, dst, method: str, group: int):
    """The checkpoint with every linear weight and the LM head replaced by its dequantized value (a tied embedding
    with it: fulcrum looks tied rows up in the quantized head's table)."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    for name, t in tensors.items():
        if name == head or (name.endswith(".weight") and any(f".{p}." in name for p in LINEAR)):
            tensors[name] = dequantized(t, method, group).contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def logits(folder, **quant):
    mc = ModelConfig.from_path(folder, "float32", **quant)
    model = load_model(mc)
    ids = torch.randint(5, 2048, (40,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        hidden = model(ids, torch.arange(40), AttentionMetadata.for_prompts([40]))
        return model.compute_logits(hidden), model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {f: save_tiny_model(f, root / f) for f in ("llama", "qwen2", "llama-bias-headdim")}


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama-bias-headdim"])
@pytest.mark.parametrize("name", METHODS)
def test_logits_and_greedy_tokens_match_the_dequantized_reference(models, tmp_path, family, name):
    if family == "llama-bias-headdim" and name == "int4-g64":
        pytest.skip("o_proj has 96 inputs: no group of 64 fits (tested below)")
    method, kw = name.split("-")[0], METHODS[name]
    group = kw.get("quantization_group_size", 128)
    ref_dir = write_reference(models[family], tmp_path / "ref", method, group)
    got, model = logits(models[family], quantization=method, **kw)
    want, _ = logits(ref_dir)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    # the quantized model really holds packed weights, and no full-precision copy of them
    qkv = model.model.layers[0].self_attn.qkv_proj
    packed = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}[method]
    assert not hasattr(qkv, "weight") and qkv.qweight.dtype == packed
    assert not hasattr(model.lm_head, "weight")
    if model.tie_word_embeddings:  # no full-precision table left for the tied embedding either
        assert not hasattr(model.model.embed_tokens, "weight")

    llm = LLM(model=str(models[family]), dtype="float32", kv_cache_memory=16 << 20, quantization=method, **kw)
    prompts = [torch.randint(5, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(ref_dir, p, 10)[0] for p in prompts]


def test_weight_bytes_fall_as_the_format_says(models):
    """int8: one byte per weight plus an fp32 scale per output channel; int4 g32: half a byte plus an fp32 scale
    and offset per 32 weights. Against 4 bytes per weight in fp32."""
    dense = load_model(ModelConfig.from_path(models["llama"], "float32"))
    shapes = [p.shape for p in dense.model.layers.parameters() if p.dim() == 2]
    int8 = sum(o * i + 4 * o for o, i in shapes)
    int4 = sum(o * i // 2 + 8 * o * i // 32 for o, i in shapes)
    for method, kw, want in (("int8", {}, int8), ("int4", {"quantization_group_size": 32}, int4)):
        model = load_model(ModelConfig.from_path(models["llama"], "float32", quantization=method, **kw))
        held = sum(b.numel() * b.element_size() for b in model.model.layers.buffers())
        assert held == want < sum(4 * o * i for o, i in shapes) / (3.5 if method == "int8" else 5)


def test_bad_settings_name_what_is_supported(models):
    with pytest.raises(InvalidRequestError, match="int8, int4, fp8"):
        LLM(model=str(models["llama"]), quantization="int3")
    with pytest.raises(InvalidRequestError, match="32, 64, 128"):
        LLM(model=str(models["llama"]), quantization="int4", quantization_group_size=48)
    with pytest.raises(ModelLoadError, match="divisible.*96.*group sizes that fit: 32"):
        LLM(model=str(models["llama-bias-headdim"]), quantization="int4", quantization_group_size=64)
