"""A llama.cpp GGUF file as a folder of Hugging Face files: config.json and generation_config.json rebuilt from its
metadata, the tokenizer transformers rebuilds from its vocabulary, and a link to the file, whose weights
fulcrum.models.gguf reads. The engine, the server and the tokenizer code then take it as any model folder."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from fulcrum.errors import ModelLoadError, UnsupportedArchitectureError, WeightLoadError

log = logging.getLogger(__name__)

# GGUF's name for an architecture -> the transformers class that fulcrum's registry runs it as. Mistral files say
# "llama" too (llama.cpp converts them as Llama).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # the text model (a vision model's tower is a file of its own, mmproj)
}
# llama.cpp's Gemma sizes whose attention scale is 1/sqrt(hidden / heads) rather than 1/sqrt(head_dim), known there
# by their layer count (Gemma 2 27B, Gemma 3 27B): query_pre_attn_scalar, which the files do not state
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's Gemma 3 (when the file states a window): five sliding layers then a global one, the sliding ones on
# a rope base of their own
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# In a GGUF file's folder: the link to the file, which the weight loader reads, and the file's table of tensors
# (name, GGML type, shape in torch's order, byte offset and length), which gguf.GGUFReader takes seconds to rebuild
# for a vocabulary of 150k tokens, since it parses every metadata string
GGUF_LINK = "model.gguf"
GGUF_TENSORS = "gguf_tensors.json"
# Part of each folder's key: a change to what the folder holds (this module) must not reuse an older folder
GGUF_FOLDER_VERSION = 2
# Llama 3's original context, which its rope settings are stated against (see llama3_rope)
LLAMA3_CONTEXT = 8192
# The types that hold values, and the dtype a model whose weights are stored in them runs in
FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def gguf_cache_root() -> Path:
    """Where GGUF files get their folders: FULCRUM_CACHE (the kernels' cache too), else ~/.cache/fulcrum."""
    return Path(os.environ.get("FULCRUM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "fulcrum"))) / "gguf"


def gguf_model_folder(file: Path) -> Path:
    """A folder of Hugging Face files for a GGUF file: config.json and generation_config.json from its metadata,
    the tokenizer transformers rebuilds from its vocabulary, and a link to the file for the weights. Built once
    per file (its path, size and modification time key the folder) in the cache, since a tokenizer of 150k
    tokens takes seconds to rebuild and the engine reads the folder from two processes; named after the file,
    which the server serves it as."""
    file = file.absolute()  # not resolved: a Hub snapshot's file links to a blob named by its hash
    stat = file.stat()
    key = f"{GGUF_FOLDER_VERSION}\0{file}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = gguf_cache_root()
    folder = root / key / file.stem
    if (folder / "config.json").exists():
        return folder
    building = root / f".{key}.{os.getpid()}"  # a whole folder or none: built aside, then renamed into place
    shutil.rmtree(building, ignore_errors=True)
    try:
        _write_gguf_folder(file, building / file.stem)
        try:
            building.rename(root / key)
        except OSError:  # another process got there first; its folder is as good
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    log.info("GGUF %s: config and tokenizer in %s", file, folder)
    return folder


def read_gguf(file: Path):
    """gguf.GGUFReader over the file (memory-mapped); a truncated file fails naming the first tensor it cuts."""
    from gguf import GGUFReader

    try:
        return GGUFReader(file)
    except (ValueError, IndexError, KeyError) as e:
        cut = _first_truncated_tensor(file)
        if cut is not None:
            raise WeightLoadError(f"GGUF file {file} is truncated: {cut}") from None
        raise WeightLoadError(f"{file} is not a readable GGUF file: {e}") from None


def _first_truncated_tensor(file: Path) -> str | None:
    """What the reader's bare numpy error does not say: which tensor runs past the end of the file."""
    try:
        from transformers.integrations.gguf import GgufHeader
    except ImportError:  # transformers before 5.x has no header-only reader
        return None
    try:
        header = GgufHeader.from_file(str(file))
    except Exception:  # noqa: BLE001 (the header itself is cut or corrupt: the caller reports the reader's error)
        return None
    size = file.stat().st_size
    for t in header.tensors:
        end = header.data_start + t.offset + t.nbytes
        if end > size:
            return f"tensor {t.name} {t.shape} ends at byte {end}, the file has {size}"
    return None


def _write_gguf_folder(file: Path, folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    folder.mkdir(parents=True)
    (folder / GGUF_LINK).symlink_to(file)
    reader = read_gguf(file)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF file {file} has architecture {arch!r}, which fulcrum cannot load from GGUF; "
            f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    names = {t.name for t in reader.tensors}
    table = [
        dict(
            name=t.name,
            type=t.tensor_type.name,
            shape=[int(d) for d in reversed(t.shape)],
            offset=int(t.data_offset),
            nbytes=int(t.n_bytes),
        )
        for t in reader.tensors
    ]
    (folder / GGUF_TENSORS).write_text(json.dumps({"architecture": arch, "tensors": table}) + "\n")

    # transformers maps llama.cpp's metadata keys to a config (the same code `from_pretrained(gguf_file=)` runs)
    config = AutoConfig.from_pretrained(folder, gguf_file=GGUF_LINK)
    config.architectures = [GGUF_ARCHITECTURES[arch]]
    config.tie_word_embeddings = "output.weight" not in names  # llama.cpp ties the head when the file has none
    if arch == "llama":  # llama.cpp states biases by the tensors alone
        config.attention_bias = "blk.0.attn_q.bias" in names
        config.mlp_bias = "blk.0.ffn_gate.bias" in names
    window = _field(reader, f"{arch}.attention.sliding_window")
    if hasattr(config, "sliding_window") or window is not None:
        # a file that states no window attends to all positions in llama.cpp; transformers reads a file named
        # "mistral" as MistralConfig, whose default window (4096) would otherwise apply
        config.sliding_window = None if window is None else int(window)
    _arch_config(reader, arch, config, names, file)
    _rope_from_gguf(reader, arch, config, file)
    config.dtype = file_dtype({t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2})
    types = gguf_block_types(table)
    if types:  # the weights stay in their blocks (fulcrum.quant.gguf), as a quantized checkpoint's do
        config.quantization_config = {"quant_method": "gguf", "types": types}
    config.save_pretrained(folder)

    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    generation = {"bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id")}
    generation["eos_token_id"] = list(dict.fromkeys(int(i) for i in eos if i is not None))
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_LINK)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"GGUF file {file}: transformers cannot rebuild its tokenizer ({e})") from None
    tokenizer.save_pretrained(folder)
    # transformers names the architecture's tokenizer class (Qwen2Tokenizer ...), whose constructor, when the folder
    # is read back, would replace the pre-tokenizer rebuilt from the file's tokenizer.ggml.pre with its own; the
    # generic class takes tokenizer.json as written
    saved = json.loads((folder / "tokenizer_config.json").read_text())
    saved = {k: v for k, v in saved.items() if k not in ("is_local", "local_files_only")}
    saved["tokenizer_class"] = "TokenizersBackend"
    (folder / "tokenizer_config.json").write_text(json.dumps(saved, indent=2) + "\n")


def _arch_config(reader, arch: str, config, names: set[str], file: Path) -> None:
    """What transformers' GGUF config leaves out or gets wrong for an architecture: the settings llama.cpp reads
    from keys that transformers does not map, and those llama.cpp fixes in its own code rather than the file."""
    key_length = _field(reader, f"{arch}.attention.key_length")
    if arch in ("qwen3", "qwen3moe", "gemma2", "gemma3"):  # transformers' defaults (Qwen3's 128) are no file's
        config.head_dim = int(key_length) if key_length else config.hidden_size // config.num_attention_heads
    if arch in ("qwen2moe", "qwen3moe"):
        config.moe_intermediate_size = int(_field(reader, f"{arch}.expert_feed_forward_length"))
        shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
        if arch == "qwen2moe" and shared is not None:
            config.shared_expert_intermediate_size = int(shared)
        # every layer holds experts in llama.cpp's graph, which renormalises the top-k weights for Qwen3-MoE only
        config.decoder_sparse_step, config.mlp_only_layers = 1, []
        config.norm_topk_prob = arch == "qwen3moe"
        dense = [i for i in range(config.num_hidden_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
        if dense:
            raise ModelLoadError(f"GGUF file {file}: layers {dense} hold no experts, which {arch} files always do")
    if arch in ("gemma2", "gemma3"):
        heads = config.num_attention_heads
        big = config.num_hidden_layers == GEMMA_27B_LAYERS[arch]
        config.query_pre_attn_scalar = config.hidden_size // heads if big else config.head_dim
        for k in ("attn_logit_softcapping", "final_logit_softcapping"):  # llama.cpp's Gemma 3 caps no scores
            cap = None if arch == "gemma3" and k.startswith("attn") else _field(reader, f"{arch}.{k}")
            setattr(config, k, None if cap is None else float(cap))
        # llama.cpp's layers: Gemma 2's alternate sliding and global, Gemma 3's are five sliding then a global one
        # (all global in a file that states no window)
        period = {"gemma2": 2, "gemma3": GEMMA3_SLIDING_PATTERN}[arch] if config.sliding_window else 1
        config.layer_types = [
            "full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(config.num_hidden_layers)
        ]
    if arch == "gemma3":
        theta = float(_field(reader, f"{arch}.rope.freq_base") or 1_000_000.0)
        config.rope_parameters = {
            "full_attention": {"rope_type": "default", "rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE},
        }
    if arch == "phi3" and {"rope_factors_long.weight", "rope_factors_short.weight"} & names:
        raise ModelLoadError(f"GGUF file {file}: Phi-3's LongRoPE factors (rope_factors_long/short) are not supported")


def gguf_block_types(table: list[dict]) -> dict[str, int]:
    """How many tensors of two or more dimensions the file holds in each block type (Q4_K: 120 ...), most first."""
    counts: dict[str, int] = {}
    for t in table:
        if len(t["shape"]) >= 2 and t["type"] not in FLOAT_DTYPES:
            counts[t["type"]] = counts.get(t["type"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def file_dtype(weight_types: set[str]) -> str:
    """The dtype of a model whose 2-D weights are stored in these GGML types (its norms are F32 in every file): the
    half type the weights are in, float32 for an all-F32 file; bfloat16 for blocks (Q8_0 ...), the activations'
    type beside weights kept in their blocks (the type such models are published in; dtype=float32 runs them too)."""
    if not weight_types <= FLOAT_DTYPES.keys():
        return "bfloat16"
    halves = weight_types - {"F32"}
    return FLOAT_DTYPES[halves.pop()] if len(halves) == 1 else "float32"


def _field(reader, key: str):
    """One metadata value as Python (a string, a number, or a list), or None."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _rope_from_gguf(reader, arch: str, config, file: Path) -> None:
    """RoPE scaling, which transformers' GGUF config leaves out: linear from the metadata, Llama 3's from the
    rope_freqs tensor of per-frequency divisors that llama.cpp's converter writes instead of the settings."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ModelLoadError(f"GGUF file {file}: RoPE scaling {kind!r} is not supported (supported: linear)")
        factor = float(_field(reader, f"{arch}.rope.scaling.factor"))
        if arch == "gemma3":  # llama.cpp scales the global layers' rope only
            full = config.rope_parameters["full_attention"]
            config.rope_parameters["full_attention"] = {**full, "rope_type": "linear", "factor": factor}
        else:
            config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": factor}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        config.rope_parameters = llama3_rope(np.asarray(freqs.data, np.float64), config, file)


def llama3_rope(divisors: np.ndarray, config, file: Path) -> dict:
    """Llama 3's rope settings from llama.cpp's rope_freqs, which divide each frequency by 1 (short waves), by
    `factor` (long waves) or by a blend between, linear in the frequency. That line fixes only two combinations of
    the three settings (original context, low and high factors), so the context is taken as Llama 3's 8192 and the
    factors solved for. Any solution gives the same frequencies, which is all the model uses; the result is checked
    by recomputing them as transformers does, and a file it does not reproduce is refused."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if len(divisors) != len(inv_freq):
        raise WeightLoadError(f"GGUF tensor rope_freqs.weight has {len(divisors)} values, the model expects {dim // 2}")
    factor = float(divisors.max())
    if factor <= 1 + 1e-6:
        return config.rope_parameters  # nothing divided: plain RoPE
    kept, full = divisors <= 1 + 1e-6, divisors >= factor * (1 - 1e-6)
    blend = ~(kept | full)
    # smooth(f) = (context / (2 pi) * f - low) / (high - low): 0 where fully divided, 1 where kept
    points = [(f, (1 / d - 1 / factor) / (1 - 1 / factor)) for f, d in zip(inv_freq[blend], divisors[blend])]
    edges = [(inv_freq[full].max(), 0.0)] if full.any() else []
    edges += [(inv_freq[kept].min(), 1.0)] if kept.any() else []
    # two blended frequencies fix the line; with fewer, the nearest wave on either side bounds it
    candidates = [points] if len(points) >= 2 else [points + [e] for e in edges] + [edges]
    expected = inv_freq / divisors
    for anchors in candidates:
        if len(anchors) < 2:
            continue
        f, smooth = np.array(anchors).T
        slope, intercept = np.polyfit(f, smooth, 1)
        if slope <= 0:
            continue
        span = LLAMA3_CONTEXT / (2 * np.pi * slope)  # high - low
        low = -intercept * span
        config.rope_parameters = {
            **config.rope_parameters,
            "rope_type": "llama3",
            "factor": factor,
            "original_max_position_embeddings": LLAMA3_CONTEXT,
            "low_freq_factor": float(low),
            "high_freq_factor": float(low + span),
        }
        got, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        if np.allclose(got.double().numpy(), expected, rtol=1e-5, atol=0):
            return config.rope_parameters
    raise ModelLoadError(f"GGUF file {file}: rope_freqs.weight is not Llama 3's RoPE scaling, which fulcrum can run")
