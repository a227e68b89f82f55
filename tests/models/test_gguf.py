"""A llama.cpp GGUF file as the model: written here from a tiny safetensors model as llama.cpp's convert_hf_to_gguf.py
writes one (its metadata keys, its gpt2 vocabulary, gguf's tensor names, Llama's q/k rows permuted for GGML's rope),
then loaded by fulcrum and held to the original's logits, tokens and tokenizer."""

import json
import math
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from fulcrum import LLM, SamplingParams
from fulcrum.config import ModelConfig
from fulcrum.errors import WeightLoadError
from fulcrum.model_folder import from_gguf
from fulcrum.models.loader import load_model
from fulcrum.utils.tokenizer import chat_prompt_ids, load_tokenizer
from tests.engine.hf_reference import hf_greedy
from tests.models.test_parity import max_diff, our_logits, prompts
from tests.tiny_models import save_tiny_model

ARCH = {"llama": "llama", "llama-bias-headdim": "llama", "llama3-rope-tied-mqa": "llama", "qwen2": "qwen2"}
FILE_TYPES = {
    Q.F32: "ALL_F32",
    Q.F16: "MOSTLY_F16",
    Q.BF16: "MOSTLY_BF16",
    Q.Q8_0: "MOSTLY_Q8_0",
    Q.Q4_0: "MOSTLY_Q4_0",
}


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    """The folders fulcrum builds for GGUF files go to the test's own folder, not ~/.cache/fulcrum."""
    monkeypatch.setattr(from_gguf, "gguf_cache_root", lambda: tmp_path / "gguf-cache")


def permute(w, n_head, n_head_kv):
    """convert_hf_to_gguf.py's LlamaModel.permute, as it is there."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: dict) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: Llama 3's scaling as per-frequency divisors."""
    rope = cfg["rope_parameters"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def write_gpt2_vocab(w, folder, cfg: dict) -> None:
    """convert_hf_to_gguf.py's _set_vocab_gpt2: the tokens (ids past the tokenizer's own as [PAD<id>], as the
    converter pads a config's larger vocab_size), their types, the merges and special ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    by_id = {i: t for t, i in tok.vocab.items()}
    added = tok.get_added_vocab()
    types = []
    for i in range(cfg["vocab_size"]):
        if i not in by_id:
            by_id[i] = f"[PAD{i}]"
            types.append(gguf.TokenType.UNUSED)
        elif by_id[i] not in added:
            types.append(gguf.TokenType.NORMAL)
        else:
            special = tok.added_tokens_decoder[i].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # what llama.cpp's pre-tokenizer check finds for a GPT-2 regex byte-level BPE
    w.add_token_list([by_id[i] for i in range(cfg["vocab_size"])])
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(w, quiet=True)


def write_gguf(folder, out, arch, qtype=Q.F32, skip=(), edit=None, add_bos=False, blocks=None):
    """A GGUF of the model in `folder`, as convert_hf_to_gguf.py writes it with --outtype f32/f16/bf16/q8_0:
    TextModel's and LlamaModel's set_gguf_parameters, _set_vocab_gpt2, 2-D weights in `qtype` and the rest F32.
    `skip` leaves tensors out, `edit(tensors)` changes them first (the corrupt files); `add_bos` asks for a BOS
    token before every prompt (as Llama 3's files do). `blocks`: {checkpoint name: (bytes, type)} written as they
    are in place of those tensors (in GGUF's row order: block types gguf has no quantizer for, mixed files).
    Ids past the tokenizer's vocabulary (a config's padded vocab_size) get [PAD<id>] tokens, as the converter's."""
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    if edit:
        edit(tensors)
    w = gguf.GGUFWriter(out, arch)
    w.add_name(folder.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim") and cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[qtype]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])

    write_gpt2_vocab(w, folder, cfg)
    if add_bos:
        w.add_add_bos_token(True)

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg["num_hidden_layers"] + 1)  # +1: the extra layer of a bad file
    if (cfg.get("rope_parameters") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg).numpy())
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in tensors.items():
        if blocks and name in blocks:
            data, raw_type = blocks[name]
            w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), data, raw_dtype=raw_type)
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute(t, nh, nh)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute(t, nh, nkv)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new in skip:
            continue
        data = t.float().numpy()
        if data.ndim < 2 or qtype == Q.F32:
            w.add_tensor(new, data)
        elif qtype == Q.F16:
            w.add_tensor(new, data.astype(np.float16))
        else:
            w.add_tensor(new, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def rounded_copy(folder, out, qtype):
    """The safetensors model with every weight the GGUF stores in `qtype` rounded as it is there: what the file
    holds exactly, for logits the loader must reproduce to float32 precision."""
    out.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    for name, t in tensors.items():
        if t.ndim == 2:
            rounded = gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), qtype), qtype)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(rounded, np.float32))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture
def model_and_gguf(tmp_path):
    def make(family, qtype=Q.F32, **kw):
        folder = save_tiny_model(family, tmp_path / family)
        return folder, write_gguf(folder, tmp_path / f"{family}-{qtype.name}.gguf", ARCH[family], qtype, **kw)

    return make


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_transformers_reads_the_written_file_back_exactly(family, model_and_gguf):
    """transformers' own GGUF reader (its names and its un-permuting) recovers the safetensors weights from the
    test's file: the file is written as llama.cpp writes one, not merely as fulcrum reads one."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file = model_and_gguf(family)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    read = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=hf)["tensors"]
    original = load_file(folder / "model.safetensors")
    assert read.keys() == original.keys()
    assert all(torch.equal(read[k], original[k]) for k in original)


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama-bias-headdim", "llama3-rope-tied-mqa"])
def test_float32_file_gives_the_safetensors_logits(family, model_and_gguf):
    folder, file = model_and_gguf(family)
    ours = load_model(ModelConfig.from_path(file))
    assert {p.dtype for p in ours.parameters()} == {torch.float32}  # the file's own type
    reference = load_model(ModelConfig.from_path(folder, dtype="float32"))
    batch = prompts(2048)
    assert max_diff(our_logits(ours, batch), our_logits(reference, batch)) <= 1e-4


# (type, bound on the largest logit difference from the unrounded model, relative to the largest logit). The file
# stores each 2-D weight rounded: F16 to 11 significant bits, BF16 to 8, Q8_0 to steps of its 32-weight block's
# largest/127, Q4_0 to steps of largest/8. These random models (weights of std 0.1, logits up to 3.5-4) turn that into,
# measured over two seeds of each family: F16 0.9-1.4e-3, BF16 0.7-1.2e-2, Q8_0 2.7-3.1e-2; the bounds leave 2-3x.
# Q4_0 (0.4-0.8) leaves too little of a random model's logits to bound: only its exactness is asserted.
QUANTIZED = [(Q.F16, 3e-3), (Q.BF16, 3e-2), (Q.Q8_0, 0.08), (Q.Q4_0, None)]


@pytest.mark.parametrize("qtype, bound", QUANTIZED, ids=[q.name for q, _ in QUANTIZED])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rounded_file_gives_the_logits_of_its_rounded_weights(family, qtype, bound, model_and_gguf, tmp_path):
    """The loader adds no error of its own: run in float32, the file's logits are those of the safetensors model
    with its weights rounded as the file rounds them (within 1e-4); and that rounding stays within `bound`
    of the original's."""
    folder, file = model_and_gguf(family, qtype)
    ours = our_logits(load_model(ModelConfig.from_path(file, dtype="float32")), batch := prompts(2048))
    rounded = rounded_copy(folder, tmp_path / "rounded", qtype)
    assert max_diff(ours, our_logits(load_model(ModelConfig.from_path(rounded, dtype="float32")), batch)) <= 1e-4
    if bound is not None:
        original = our_logits(load_model(ModelConfig.from_path(folder, dtype="float32")), batch)
        scale = max(x.abs().max().item() for x in original)
        assert max_diff(ours, original) <= bound * scale


@pytest.mark.parametrize(
    "qtype, dtype", [(Q.F32, torch.float32), (Q.F16, torch.float16), (Q.BF16, torch.bfloat16), (Q.Q8_0, torch.bfloat16)]
)
def test_auto_dtype_follows_the_file(qtype, dtype, model_and_gguf):
    """A float file runs in its own type; blocks, dequantized, in bfloat16 (the type such models ship in)."""
    _, file = model_and_gguf("llama", qtype)
    assert ModelConfig.from_path(file).dtype == dtype


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_greedy_tokens_equal_transformers_on_the_original(family, model_and_gguf):
    folder, file = model_and_gguf(family)
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(5, 2048, (n,), generator=g).tolist() for n in (3, 17, 40)]
    llm = LLM(model=str(file), dtype="float32", kv_cache_memory=16 << 20, seed=0)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for p, o in zip(batch, outs):
        assert o.outputs[0].token_ids == hf_greedy(folder, p, 10)[0]


def test_tokenizer_is_rebuilt_from_the_vocabulary(model_and_gguf):
    folder, file = model_and_gguf("llama")
    path = ModelConfig.from_path(file).path
    ours, original = load_tokenizer(path), load_tokenizer(folder)
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n  It's 1604 <|user|> Æsop’s café 😀"
    assert ours(text).input_ids == original(text).input_ids
    assert ours.decode(ours(text).input_ids) == text
    chat = [{"role": "user", "content": "Speak, speak."}]
    assert chat_prompt_ids(ours, chat) == chat_prompt_ids(original, chat)  # the chat template travels in the file
    # llama.cpp's converter takes the tokenizer's eos (this tiny model's config.json says otherwise)
    assert ModelConfig.from_path(file).eos_token_ids == [original.eos_token_id]


def test_a_file_that_asks_for_bos_gets_it_before_every_prompt(model_and_gguf):
    _, file = model_and_gguf("llama", add_bos=True)
    tokenizer = load_tokenizer(ModelConfig.from_path(file).path)
    ids = tokenizer("Speak, speak.").input_ids
    assert (
        ids[0] == tokenizer.bos_token_id and ids[1:] == tokenizer("Speak, speak.", add_special_tokens=False).input_ids
    )


def test_folder_is_built_once_and_named_after_the_file(model_and_gguf):
    _, file = model_and_gguf("qwen2")
    first = ModelConfig.from_path(file).path
    assert first.name == file.stem  # what `fulcrum serve` serves it as
    config = first / "config.json"
    built = config.stat().st_mtime_ns
    assert ModelConfig.from_path(file).path == first and config.stat().st_mtime_ns == built
    os.utime(file, ns=(built + 10**9, built + 10**9))  # the file changed: a folder of its own
    assert ModelConfig.from_path(file).path != first


def test_missing_tensor_is_named(model_and_gguf):
    _, file = model_and_gguf("llama", skip={"blk.1.attn_k.weight"})
    with pytest.raises(WeightLoadError, match=r"blk\.1\.attn_k\.weight \(model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(ModelConfig.from_path(file))


def test_wrong_shape_names_the_tensor_and_both_shapes(model_and_gguf):
    name = "model.layers.0.mlp.down_proj.weight"
    _, file = model_and_gguf("llama", Q.Q8_0, edit=lambda t: t.update({name: torch.zeros(64, 96)}))
    with pytest.raises(WeightLoadError) as err:
        load_model(ModelConfig.from_path(file))
    assert "blk.0.ffn_down.weight" in str(err.value) and "(64, 96)" in str(err.value) and "(64, 128)" in str(err.value)


def test_truncated_file_names_the_tensor_it_cuts(model_and_gguf):
    _, file = model_and_gguf("llama")
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(WeightLoadError, match=r"truncated: tensor \S+\.weight"):
        ModelConfig.from_path(file)


def test_extra_tensor_is_named(model_and_gguf):
    extra = "model.layers.2.self_attn.q_proj.weight"  # a third layer the metadata does not count
    _, file = model_and_gguf("qwen2", edit=lambda t: t.update({extra: torch.zeros(64, 64)}))
    with pytest.raises(WeightLoadError, match=r"blk\.2\.attn_q\.weight"):
        load_model(ModelConfig.from_path(file))
