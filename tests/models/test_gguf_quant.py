"""GGUF block types run as stored: each type's weights are the file's integers and scales in fulcrum's int4 / grouped
int8 layouts, so the logits equal those of the model with the file's dequantized weights (gguf's, llama.cpp's
formula) to float rounding; a mixed file keeps each tensor in its own type; the memory held is the quantized size.
Files are written here: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 by the gguf package's quantizers, the K-quants (which gguf can
only dequantize) as random blocks of realistic scales."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, dequantize, quantize
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from fulcrum import LLM, SamplingParams
from fulcrum.config import ModelConfig
from fulcrum.errors import ModelLoadError, WeightLoadError
from fulcrum.kernels import cpu_decode_stack
from fulcrum.models.loader import load_model
from fulcrum.quant.gguf import LAYOUTS
from tests.models.test_gguf import gguf_cache, permute, write_gguf  # noqa: F401  (the fixture)
from tests.models.test_parity import max_diff, our_logits, prompts
from tests.tiny_models import save_tiny_model

QUANTIZERS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]  # gguf.quants quantizes these
KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# each type's fp16 fields (byte offsets in a block) and the largest |integer x sub-block scale| they multiply
FP16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
LARGEST = {"Q2_K": 15 * 3, "Q3_K": 32 * 4, "Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 128 * 32}


# K-quants take rows of whole 256-value super-blocks: the tiny models at 256 wide
WIDE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def tiny(family, tmp_path):
    return save_tiny_model(family, tmp_path / family, **WIDE)


def random_blocks(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    """Valid blocks of a K-quant for a [rows, cols] weight: random integers and sub-block scales, the super-block
    scales (fp16) set so that the weights reach about 0.1, as a trained model's do."""
    per, size = GGML_QUANT_SIZES[Q[qtype]]
    b = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        d = rng.uniform(0.5, 1.5, (rows, cols // per, 1)) * 0.1 / LARGEST[qtype]
        b[..., at : at + 2] = d.astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def quantized_files(folder, tmp_path, arch, type_of, seed=0):
    """(the GGUF file, a safetensors copy of the model whose weights are the file's dequantized values). `type_of`:
    checkpoint name -> GGML type name for each 2-D weight (None: float32)."""
    rng = np.random.default_rng(seed)
    tensors = load_file(folder / "model.safetensors")
    cfg = ModelConfig.from_path(folder, dtype="float32").hf_config
    blocks = {}
    for name, t in tensors.items():
        qtype = type_of(name) if t.ndim == 2 else None
        if qtype is None:
            continue
        rows_perm = None
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            kv = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            rows_perm = permute(torch.arange(t.shape[0])[:, None], cfg.num_attention_heads, kv)[:, 0]
        if qtype in QUANTIZERS or qtype == "MXFP4":
            src = t if rows_perm is None else t[rows_perm]
            b = quantize(src.float().numpy(), Q[qtype])
        else:
            b = random_blocks(qtype, *t.shape, rng)
        stored = torch.from_numpy(np.ascontiguousarray(dequantize(b, Q[qtype]), np.float32))
        if rows_perm is not None:  # the file's rows are in GGML's rotary order: the model's are put back
            stored = torch.empty_like(stored).index_copy_(0, rows_perm, stored)
        tensors[name] = stored.reshape(t.shape)
        blocks[name] = (b, Q[qtype])
    reference = tmp_path / "reference"
    reference.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (reference / f.name).write_bytes(f.read_bytes())
    save_file(tensors, reference / "model.safetensors", metadata={"format": "pt"})
    file = write_gguf(folder, tmp_path / "model.gguf", arch, blocks=blocks)
    return file, reference


def parts_of(model) -> dict[str, list[tuple[str, list[str]]]]:
    return {
        n: [(p.layout, p.types) for p in m.gguf_parts] for n, m in model.named_modules() if hasattr(m, "gguf_parts")
    }


@pytest.mark.parametrize("qtype", QUANTIZERS + KQUANTS)
def test_each_block_type_gives_the_logits_of_its_dequantized_weights(qtype, tmp_path):
    folder = tiny("qwen2", tmp_path)
    file, reference = quantized_files(folder, tmp_path, "qwen2", lambda name: qtype)
    ours = load_model(ModelConfig.from_path(file, dtype="float32"))
    layout = LAYOUTS[qtype][0]
    assert all(p == [(layout, [qtype] * len(p[0][1]))] for p in parts_of(ours).values())  # kept in its bits
    batch = prompts(2048)
    got, want = (
        our_logits(ours, batch),
        our_logits(load_model(ModelConfig.from_path(reference, dtype="float32")), batch),
    )
    scale = max(x.abs().max().item() for x in want)
    assert max_diff(got, want) <= 1e-4 * scale  # float32 rounding only (sums in another order)
    # the file's own dtype (bfloat16 activations: the integer-dot kernels where the CPU has them) within bf16's
    bf16 = our_logits(load_model(ModelConfig.from_path(file)), batch)
    assert max_diff(bf16, want) <= 0.05 * scale


def test_llama_rows_in_blocks_are_put_back_in_rotary_order(tmp_path):
    folder = tiny("llama", tmp_path)
    file, reference = quantized_files(folder, tmp_path, "llama", lambda name: "Q4_K")
    batch = prompts(2048)
    got = our_logits(load_model(ModelConfig.from_path(file, dtype="float32")), batch)
    want = our_logits(load_model(ModelConfig.from_path(reference, dtype="float32")), batch)
    assert max_diff(got, want) <= 1e-4 * max(x.abs().max().item() for x in want)


def q4_k_m(name: str) -> str | None:
    """llama.cpp's Q4_K_M mix in small: Q6_K for v and down projections and the embedding table, Q4_K elsewhere."""
    if name.endswith(("v_proj.weight", "down_proj.weight", "embed_tokens.weight")):
        return "Q6_K"
    return "Q4_K"


def test_a_mixed_file_keeps_each_tensor_in_its_own_type(tmp_path):
    folder = tiny("qwen2", tmp_path)
    file, reference = quantized_files(folder, tmp_path, "qwen2", q4_k_m)
    ours = load_model(ModelConfig.from_path(file, dtype="float32"))
    parts = parts_of(ours)
    assert parts["model.layers.0.self_attn.qkv_proj"] == [("int4", ["Q4_K", "Q4_K"]), ("int8g", ["Q6_K"])]
    assert parts["model.layers.0.mlp.gate_up_proj"] == [("int4", ["Q4_K", "Q4_K"])]
    assert parts["model.layers.0.mlp.down_proj"] == [("int8g", ["Q6_K"])]
    assert parts["lm_head"] == [("int8g", ["Q6_K"])]  # the tied table, once, read by the embedding too
    assert not hasattr(ours.model.embed_tokens, "weight")
    batch = prompts(2048)
    want = our_logits(load_model(ModelConfig.from_path(reference, dtype="float32")), batch)
    assert max_diff(our_logits(ours, batch), want) <= 1e-4 * max(x.abs().max().item() for x in want)


def held_bytes(model) -> int:
    """Bytes of the weights after load (the rotary tables, which no file holds, left out)."""
    seen, total = set(), 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "rotary" not in name and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


# bits a weight holds after load per type (fulcrum.quant.gguf's table): the file's 4.5 / 8.5 / 6.5625
HELD_BITS = {"Q4_0": 5, "Q8_0": 9, "Q6_K": 10, "Q5_0": 6, "Q5_K": 7}


@pytest.mark.parametrize("qtype", list(HELD_BITS))
def test_memory_held_is_the_quantized_size_not_bf16s(qtype, tmp_path):
    folder = tiny("qwen2", tmp_path)
    file, _ = quantized_files(folder, tmp_path, "qwen2", lambda name: qtype)
    model = load_model(ModelConfig.from_path(file))
    weights = sum(t.numel() for n, t in load_file(folder / "model.safetensors").items() if t.ndim == 2)
    small = sum(t.numel() * 4 for t in load_file(folder / "model.safetensors").values() if t.ndim < 2)
    # the 2-D weights at their held bits, norms and biases in bf16: nothing of them dequantized to bf16
    assert held_bytes(model) <= weights * HELD_BITS[qtype] / 8 + small
    assert held_bytes(model) < 0.8 * weights * 2


def test_float_tensors_of_a_quantized_file_stay_dense_beside_the_blocks(tmp_path):
    folder = tiny("qwen2", tmp_path)
    file, reference = quantized_files(folder, tmp_path, "qwen2", lambda n: None if "o_proj" in n else "Q8_0")
    ours = load_model(ModelConfig.from_path(file, dtype="float32"))
    assert parts_of(ours)["model.layers.1.self_attn.o_proj"] == [("dense", ["float32"])]
    batch = prompts(2048)
    want = our_logits(load_model(ModelConfig.from_path(reference, dtype="float32")), batch)
    assert max_diff(our_logits(ours, batch), want) <= 1e-4 * max(x.abs().max().item() for x in want)


def test_engine_serves_a_quantized_file_with_its_formats_named(tmp_path, caplog):
    folder = tiny("qwen2", tmp_path)
    file, reference = quantized_files(folder, tmp_path, "qwen2", q4_k_m)
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(5, 2048, (n,), generator=g).tolist() for n in (3, 17, 40)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with caplog.at_level("INFO"):
        ours = LLM(model=str(file), dtype="float32", kv_cache_memory=16 << 20, seed=0).generate(
            batch, sp, use_tqdm=False
        )
    assert "gguf (Q4_K x" in caplog.text and "Q6_K x" in caplog.text
    want = LLM(model=str(reference), dtype="float32", kv_cache_memory=16 << 20, seed=0).generate(
        batch, sp, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in want]


def test_quantization_is_refused_for_a_quantized_file(tmp_path):
    folder = tiny("qwen2", tmp_path)
    file, _ = quantized_files(folder, tmp_path, "qwen2", lambda name: "Q4_0")
    with pytest.raises(ModelLoadError, match=r"already quantized \(gguf\).*'int8'"):
        ModelConfig.from_path(file, quantization="int8")
    assert ModelConfig.from_path(file, quantization="gguf").quantization == "gguf"


def test_a_block_with_a_scale_that_is_not_a_number_is_named(tmp_path):
    folder = tiny("qwen2", tmp_path)
    file, _ = quantized_files(folder, tmp_path, "qwen2", lambda name: "Q8_0")
    data = bytearray(file.read_bytes())
    model = ModelConfig.from_path(file)  # the folder lists where each tensor lies
    import json

    listing = json.loads((model.path / "gguf_tensors.json").read_text())["tensors"]
    t = next(t for t in listing if t["name"] == "blk.1.ffn_down.weight")
    data[t["offset"] + 34 * 5 : t["offset"] + 34 * 5 + 2] = np.array([np.nan], np.float16).view(np.uint8).tobytes()
    file.write_bytes(bytes(data))
    with pytest.raises(WeightLoadError, match=r"blk\.1\.ffn_down\.weight \(Q8_0\) is corrupt: a block of row \d+"):
        load_model(ModelConfig.from_path(file))


def test_truncated_quantized_file_names_the_tensor_it_cuts(tmp_path):
    folder = tiny("qwen2", tmp_path)
    file, _ = quantized_files(folder, tmp_path, "qwen2", q4_k_m)
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(WeightLoadError, match=r"truncated: tensor \S+\.weight"):
        ModelConfig.from_path(file)


@pytest.mark.skipif(not cpu_decode_stack.available(), reason="the decode stack needs AVX2 and a compiler")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_runs_a_mixed_file_as_the_modules_do(dtype, tmp_path):
    """The decode stack takes each layer's parts (Q4_K rows and Q6_K rows of one qkv) through their own kernels."""
    from tests.engine.test_llm_parity import random_prompts
    from tests.kernels.test_cpu_decode_stack import assert_same, run

    file, _ = quantized_files(tiny("qwen2", tmp_path), tmp_path, "qwen2", q4_k_m)
    llm = LLM(model=str(file), dtype=dtype, kv_cache_memory=16 << 20, enable_prefix_caching=False)
    for count in (1, 6):
        prompts = random_prompts(count, 3, 30, seed=count)
        fused = run(llm, prompts, True)
        assert fused[2], "the fused stack was not used"
        assert_same(fused, run(llm, prompts, False), 1e-4 if dtype == "float32" else 0.05)


def test_served_file_names_its_types_on_the_startup_line_and_in_metrics(tmp_path):
    """`fulcrum serve FILE.gguf`: the startup line and /metrics name the block types and the bytes held; a
    --quantization on such a file is a one-line error."""
    import os
    import subprocess
    import sys

    import httpx

    from fulcrum.utils.serve_process import start

    file, _ = quantized_files(tiny("qwen2", tmp_path), tmp_path, "qwen2", q4_k_m)
    env = {"FULCRUM_CACHE": str(tmp_path / "cache")}
    with start(file, "--kv-cache-memory", "0.05", log_path=tmp_path / "server.log", timeout=120, env=env) as s:
        text = httpx.get(f"{s.url}/metrics").text
        assert 'fulcrum:model_weights_bytes{model_name="model",quantization="gguf (Q4_K x ' in text
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "model", "prompt": "ROMEO:", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert "| weights: gguf (Q4_K x " in (tmp_path / "server.log").read_text()
    res = subprocess.run([sys.executable, "-m", "fulcrum.cli", "serve", str(file), "--quantization", "int8"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **env})  # fmt: skip
    assert res.returncode == 2 and "already quantized (gguf)" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_type_without_a_kernel_is_dequantized_and_named(tmp_path, caplog):
    """MXFP4 (gpt-oss's experts' format) has no kernel here: its tensors load dense, the log names them and the
    error of the copy, and the logits stay those of the file's values."""
    file, reference = quantized_files(tiny("qwen2", tmp_path), tmp_path, "qwen2",
                                      lambda n: "MXFP4" if "o_proj" in n else "Q8_0")  # fmt: skip
    with caplog.at_level("INFO"):
        ours = load_model(ModelConfig.from_path(file, dtype="float32"))
    assert parts_of(ours)["model.layers.0.self_attn.o_proj"] == [("dense", ["MXFP4 (dequantized)"])]
    assert "MXFP4 has no kernel here, dequantized to float32 (largest error 0 " in caplog.text
    batch = prompts(2048)
    want = our_logits(load_model(ModelConfig.from_path(reference, dtype="float32")), batch)
    assert max_diff(our_logits(ours, batch), want) <= 1e-4 * max(x.abs().max().item() for x in want)
