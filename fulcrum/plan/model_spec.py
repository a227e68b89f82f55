"""A model's shape from its config.json alone: parameter counts (total and, for MoE, active) and KV-cache bytes,
for GQA/MQA, an explicit head_dim, DeepSeek's MLA, sliding-window layers and mixture-of-experts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from fulcrum.errors import ModelLoadError
from fulcrum.model_folder.hf_config import head_dim, layer_sliding_windows

PRESETS = Path(__file__).with_name("presets.json")
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "fp4": 0.5}
# a checkpoint that keeps its routed experts' matrices in a format of their own (gpt-oss's MXFP4: a 4-bit value and
# one E8M0 exponent byte per 32, as fulcrum holds them), bytes per parameter; the rest is at the weight dtype
EXPERT_FORMAT_BYTES = {"mxfp4": (4 + 8 / 32) / 8}
# config.json's torch_dtype / dtype, in plan's names
CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention: the cache holds one compressed latent (+ the shared RoPE key) per token."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class MoE:
    num_experts: int
    experts_per_token: int
    expert_intermediate: int
    shared_intermediate: int = 0  # always-on shared expert(s), summed
    dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek's first_k_dense_replace)
    biases: bool = False  # gpt-oss: biases on the experts' projections
    router_bias: bool = False  # gpt-oss's router bias, DeepSeek-V3's score-correction bias
    shared_gate: bool = False  # Qwen2-MoE: a sigmoid gate (hidden -> 1) on the shared expert


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int  # per token: everything but the routed experts a token does not use
    embedding: int
    lm_head: int  # 0 when tied to the embedding


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sinks: bool
    mlp_bias: bool
    windows: tuple[int | None, ...]  # per layer: sliding window, None = full attention
    dtype: str
    mla: MLA | None = None
    moe: MoE | None = None
    max_position_embeddings: int | None = None  # the longest context the model was trained for, when stated
    # what a pre-quantized checkpoint stores its linear weights as (quantization_config), in plan's names
    weight_format: str | None = None
    norms_per_layer: int = 2  # RMSNorms around attention and MLP: Gemma 2/3 have four (before and after each)
    # a block-wise fp8 checkpoint's weight_block_size (quant_method "fp8": DeepSeek-V3, Qwen3-FP8): its linear
    # weights are counted as the engine holds them (`weight_bytes`), not every parameter at weight_format
    weight_block: tuple[int, int] | None = None
    expert_format: str | None = None  # the routed experts' own format (EXPERT_FORMAT_BYTES), None: the weights'

    @property
    def attention_kind(self) -> str:
        if self.mla:
            return f"MLA (latent {self.mla.kv_lora_rank} + RoPE key {self.mla.qk_rope_head_dim} per token)"
        if self.num_kv_heads == 1:
            return f"MQA ({self.num_heads} query heads, 1 KV head)"
        if self.num_kv_heads < self.num_heads:
            return f"GQA ({self.num_heads} query heads, {self.num_kv_heads} KV heads)"
        return f"MHA ({self.num_heads} heads)"

    def details(self) -> list[str]:
        """Everything about the architecture that changes memory or speed, in words."""
        out = [self.attention_kind]
        if self.head_dim * self.num_heads != self.hidden and not self.mla:
            out.append(f"explicit head_dim {self.head_dim} (hidden/heads would be {self.hidden // self.num_heads})")
        sliding = [w for w in self.windows if w]
        if sliding:
            out.append(f"{len(sliding)} of {self.num_layers} layers slide over {sliding[0]} tokens")
        if self.moe:
            m = self.moe
            shared = f", shared expert {m.shared_intermediate}" if m.shared_intermediate else ""
            dense = f", first {m.dense_layers} layers dense" if m.dense_layers else ""
            out.append(f"MoE: {m.experts_per_token} of {m.num_experts} experts per token{shared}{dense}")
        out.append("tied embeddings" if self.tied else "untied embeddings")
        return out


def checkpoint_weight_format(cfg: dict) -> str | None:
    """The weight format of a GPTQ, AWQ or compressed-tensors checkpoint that fulcrum reads (int4, int8, fp8); None
    for another or none. Every parameter is then counted at it, the LM head and ignored modules too (a few %)."""
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower().replace("_", "-")
    if method == "fp8" and q.get("weight_block_size"):
        return "fp8"
    if method in ("gptq", "awq"):
        return {4: "int4", 8: "int8"}.get(q.get("bits") or q.get("w_bit") or 4)
    if method == "compressed-tensors":
        groups = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values()]
        names = {f"{'fp' if w.get('type') == 'float' else 'int'}{w.get('num_bits', 8)}" for w in groups if w}
        return names.pop() if len(names) == 1 and names <= {"int4", "int8", "fp8"} else None
    return None


# the sizes a plan reads, each a whole number from 1 to its bound: far past any model's, so that a config that
# is not one (10^9 layers) is refused at once rather than planned for minutes
CONFIG_BOUNDS = {
    "num_hidden_layers": 10_000,
    "hidden_size": 1 << 20,
    "vocab_size": 1 << 24,
    "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14,
    "intermediate_size": 1 << 22,
    "head_dim": 1 << 14,
    "max_position_embeddings": 1 << 30,
    "moe_intermediate_size": 1 << 22,
    "num_local_experts": 1 << 16,
    "n_routed_experts": 1 << 16,
    "num_experts": 1 << 16,
    "num_experts_per_tok": 1 << 16,
    "kv_lora_rank": 1 << 16,
}
REQUIRED = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "intermediate_size")


def check_config(cfg) -> None:
    """A config.json's sizes, named when missing or out of range (ValueError), before any arithmetic on them."""
    if not isinstance(cfg, dict):
        raise ValueError("config.json must hold a JSON object")
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"config.json has no {', '.join(missing)}")
    for key, bound in CONFIG_BOUNDS.items():
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            raise ValueError(f"config.json: {key} must be a whole number from 1 to {bound:,}, got {value!r}")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv_heads:
        raise ValueError(
            f"config.json: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )


def from_config(cfg: dict, name: str = "model") -> ModelSpec:
    if not isinstance(cfg, dict):
        raise ValueError("config.json must hold a JSON object")
    weight_format = checkpoint_weight_format(cfg)
    cfg_outer, cfg = cfg, cfg.get("text_config", cfg)  # multimodal configs keep the language model's fields there
    check_config(cfg)
    ns = SimpleNamespace(**cfg)
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MLA(
            cfg.get("q_lora_rank"),
            cfg["kv_lora_rank"],
            cfg["qk_nope_head_dim"],
            cfg["qk_rope_head_dim"],
            cfg["v_head_dim"],
        )
    experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts")
    moe = None
    if experts and experts > 1:
        expert_i = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        shared = cfg.get("n_shared_experts", 0) * expert_i + cfg.get("shared_expert_intermediate_size", 0)
        moe = MoE(
            num_experts=experts,
            experts_per_token=cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 1,
            expert_intermediate=expert_i,
            shared_intermediate=shared,
            dense_layers=_dense_moe_layers(cfg),
            biases=cfg.get("model_type") == "gpt_oss",
            router_bias=cfg.get("model_type") in ("gpt_oss", "deepseek_v3"),
            shared_gate=cfg.get("model_type") == "qwen2_moe" and bool(cfg.get("shared_expert_intermediate_size")),
        )
    model_type = cfg.get("model_type", "")
    stated = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
    return ModelSpec(
        name=name,
        num_layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        vocab=cfg["vocab_size"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=head_dim(ns),
        intermediate=cfg["intermediate_size"],
        tied=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 puts biases on q, k, v only; attention_bias (Llama, gpt-oss) means q, k, v and o
        qkv_bias=bool(cfg.get("attention_bias")) or model_type in ("qwen2", "qwen2_moe"),
        o_bias=bool(cfg.get("attention_bias")),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
        sinks=model_type == "gpt_oss",
        mlp_bias=bool(cfg.get("mlp_bias")),
        windows=tuple(layer_sliding_windows(ns)) if not mla else (None,) * cfg["num_hidden_layers"],
        dtype=CONFIG_DTYPES.get(stated, "bf16"),
        mla=mla,
        moe=moe,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        weight_format=weight_format,
        weight_block=_weight_block(cfg_outer),
        norms_per_layer=4 if model_type in ("gemma2", "gemma3", "gemma3_text") else 2,
        expert_format=checkpoint_expert_format(cfg) if moe else None,
    )


def _weight_block(cfg: dict) -> tuple[int, int] | None:
    q = cfg.get("quantization_config") or {}
    block = q.get("weight_block_size") if str(q.get("quant_method", "")).lower() == "fp8" else None
    ok = isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
    return (block[0], block[1]) if ok else None


def checkpoint_expert_format(cfg: dict) -> str | None:
    """gpt-oss's `quant_method: mxfp4`: its experts' matrices are MXFP4 (biases, router, attention stay 16-bit)."""
    method = str((cfg.get("quantization_config") or {}).get("quant_method", "")).lower()
    return method if method in EXPERT_FORMAT_BYTES else None


def _dense_moe_layers(cfg: dict) -> int:
    """Layers of a MoE model with a dense MLP: DeepSeek's first_k_dense_replace leading ones; Qwen-MoE's
    mlp_only_layers and the layers off its decoder_sparse_step (a layer i is sparse when (i + 1) % step == 0)."""
    if cfg.get("model_type") in ("qwen2_moe", "qwen3_moe"):
        step = cfg.get("decoder_sparse_step") or 1
        only = set(cfg.get("mlp_only_layers") or [])
        return sum(1 for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step != 0)
    return cfg.get("first_k_dense_replace", 0)


def load_presets() -> dict[str, dict]:
    return {k: v for k, v in json.loads(PRESETS.read_text()).items() if not k.startswith("_")}


def load_model_spec(model: str | Path) -> ModelSpec:
    """MODEL is a built-in preset name, a Hugging Face folder (its config.json is read; never its weights),
    or a config.json file."""
    presets = load_presets()
    key = str(model).lower()
    if key in presets:
        return from_config(presets[key]["config"], name=key)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise ModelLoadError(f"{model} is a folder without config.json; plan needs the model's config.json")
    elif not path.exists():
        raise ModelLoadError(
            f"{model!r} is neither a model folder, a config.json, nor a preset; presets: {', '.join(presets)}"
        )
    name = path.parent.name if path.name == "config.json" else path.stem
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return from_config(cfg, name=name)


# -- parameters ------------------------------------------------------------------------------------


def attention_params(s: ModelSpec) -> int:
    """One layer's attention projections, norms inside attention and biases."""
    h = s.hidden
    if s.mla:
        m = s.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * s.num_heads * qk
        else:
            q = h * s.num_heads * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * s.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + s.num_heads * m.v_head_dim * h
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    n = h * q + 2 * h * kv + q * h
    n += (q + 2 * kv) * s.qkv_bias + h * s.o_bias + 2 * s.head_dim * s.qk_norm + s.num_heads * s.sinks
    return n


def _mlp(h: int, i: int, bias: bool = False) -> int:
    """A gated MLP (gate, up, down), optionally with biases."""
    return 3 * h * i + (2 * i + h) * bias


def mlp_params(s: ModelSpec) -> tuple[int, int]:
    """(total, active per token) of the MLPs of all layers."""
    if not s.moe:
        n = s.num_layers * _mlp(s.hidden, s.intermediate, s.mlp_bias)
        return n, n
    m = s.moe
    dense = m.dense_layers * _mlp(s.hidden, s.intermediate)
    router = s.hidden * m.num_experts + m.num_experts * m.router_bias
    expert = _mlp(s.hidden, m.expert_intermediate, m.biases)
    shared = _mlp(s.hidden, m.shared_intermediate) + s.hidden * m.shared_gate if m.shared_intermediate else 0
    sparse = s.num_layers - m.dense_layers
    total = dense + sparse * (router + m.num_experts * expert + shared)
    active = dense + sparse * (router + m.experts_per_token * expert + shared)
    return total, active


def parameter_counts(s: ModelSpec) -> ParamCount:
    norms = s.num_layers * s.norms_per_layer * s.hidden + s.hidden  # the layers' RMSNorms, one final
    attn = s.num_layers * attention_params(s)
    mlp_total, mlp_active = mlp_params(s)
    emb = s.vocab * s.hidden
    head = 0 if s.tied else emb
    base = norms + attn + emb + head
    return ParamCount(total=base + mlp_total, active=base + mlp_active, embedding=emb, lm_head=head)


# -- KV cache --------------------------------------------------------------------------------------


# fulcrum's one-byte KV caches (--kv-cache-dtype fp8|int8) keep an fp16 scale per token and KV head
KV_SCALE_BYTES = {"fp8": 2.0, "int8": 2.0}


def kv_bytes_per_token_layer(s: ModelSpec, kv_dtype: str) -> float:
    if s.mla:  # the latent and the RoPE key, shared by all heads
        return (s.mla.kv_lora_rank + s.mla.qk_rope_head_dim) * DTYPE_BYTES[kv_dtype] + KV_SCALE_BYTES.get(kv_dtype, 0)
    return 2 * s.num_kv_heads * (s.head_dim * DTYPE_BYTES[kv_dtype] + KV_SCALE_BYTES.get(kv_dtype, 0))


def kv_bytes_per_token(s: ModelSpec, kv_dtype: str = "bf16") -> float:
    """What one more token costs in every layer (a sliding layer's cost stops growing past its window)."""
    return s.num_layers * kv_bytes_per_token_layer(s, kv_dtype)


def kv_bytes_per_sequence(s: ModelSpec, length: int, kv_dtype: str = "bf16") -> float:
    """One sequence of `length` tokens; sliding-window layers keep only their window."""
    per = kv_bytes_per_token_layer(s, kv_dtype)
    return sum(per * min(length, w or length) for w in s.windows)


# -- resident weight bytes -------------------------------------------------------------------------


FP8_SCALE_BYTES = 4  # a block-wise fp8 checkpoint's scales, fp32, widened by the engine to one per row and block


def fp8_block_matrices(s: ModelSpec) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(out, in) of the linear weights a block-wise fp8 checkpoint stores in fp8: (every layer's, one routed expert's
    three). Not the LM head, embedding, norms or routers (full precision there), nor MLA's kv_b_proj, which the
    engine widens to the model's dtype at load (its W_UK and W_UV)."""
    h = s.hidden
    attn: list[tuple[int, int]] = []
    if s.mla:
        m = s.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = [(m.q_lora_rank, h), (s.num_heads * qk, m.q_lora_rank)] if m.q_lora_rank else [(s.num_heads * qk, h)]
        attn = [*q, (m.kv_lora_rank + m.qk_rope_head_dim, h), (h, s.num_heads * m.v_head_dim)]
    else:
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        attn = [(q, h), (kv, h), (kv, h), (h, q)]

    def mlp(i: int) -> list[tuple[int, int]]:
        return [(i, h), (i, h), (h, i)]

    layers = attn * s.num_layers
    expert: list[tuple[int, int]] = []
    if s.moe:
        m = s.moe
        layers += mlp(s.intermediate) * m.dense_layers
        sparse = s.num_layers - m.dense_layers
        if m.shared_intermediate:
            layers += mlp(m.shared_intermediate) * sparse
        expert = mlp(m.expert_intermediate)
    else:
        layers += mlp(s.intermediate) * s.num_layers
    return layers, expert


def fp8_block_bytes(s: ModelSpec, matrices: list[tuple[int, int]]) -> float:
    """One byte per weight and an fp32 scale per row and block of inputs; a matrix with several blocks of inputs is
    held block-major, a last block cut short padded to a whole one."""
    cols = s.weight_block[1]
    total = 0
    for o, i in matrices:
        blocks = -(-i // cols)
        total += o * (blocks * cols if blocks > 1 else i) + FP8_SCALE_BYTES * o * blocks
    return total


def weight_bytes(s: ModelSpec, weight_dtype: str) -> float:
    """Bytes the weights take in memory: every parameter at `weight_dtype`; a block-wise fp8 checkpoint read as it
    is (weight_dtype its fp8), its fp8 linear weights with their scales and the rest at the model's dtype; an MXFP4
    checkpoint's routed-expert matrices at 4.25 bits, as the engine keeps them."""
    total = parameter_counts(s).total
    if s.expert_format is not None:  # MXFP4 experts (gpt-oss): each as `expert_bytes`, the rest at weight_dtype
        m = s.moe
        experts = (s.num_layers - m.dense_layers) * m.num_experts
        rest = total - experts * _mlp(s.hidden, m.expert_intermediate, m.biases)
        return rest * DTYPE_BYTES[weight_dtype] + experts * expert_bytes(s, weight_dtype)
    if s.weight_block is None or weight_dtype != s.weight_format:
        return total * DTYPE_BYTES[weight_dtype]
    layers, expert = fp8_block_matrices(s)
    sparse = s.num_layers - s.moe.dense_layers if s.moe else 0
    experts = s.moe.num_experts * sparse if s.moe else 0
    fp8_params = sum(o * i for o, i in layers) + experts * sum(o * i for o, i in expert)
    fp8 = fp8_block_bytes(s, layers) + experts * fp8_block_bytes(s, expert)
    return fp8 + (total - fp8_params) * DTYPE_BYTES[s.dtype]


def expert_bytes(s: ModelSpec, weight_dtype: str) -> float:
    """One routed expert of one layer, as `weight_bytes` counts it."""
    m = s.moe
    if s.weight_block is not None and weight_dtype == s.weight_format:
        return fp8_block_bytes(s, fp8_block_matrices(s)[1])
    if s.expert_format is not None:
        matrices = 3 * s.hidden * m.expert_intermediate
        biases = (2 * m.expert_intermediate + s.hidden) * m.biases
        return matrices * EXPERT_FORMAT_BYTES[s.expert_format] + biases * DTYPE_BYTES[weight_dtype]
    return _mlp(s.hidden, m.expert_intermediate, m.biases) * DTYPE_BYTES[weight_dtype]


def active_weight_bytes(s: ModelSpec, weight_dtype: str) -> float:
    """What one token's forward pass reads of `weight_bytes`: all but the routed experts it does not use."""
    if not s.moe:
        return weight_bytes(s, weight_dtype)
    m = s.moe
    unused = (m.num_experts - m.experts_per_token) * (s.num_layers - m.dense_layers)
    return weight_bytes(s, weight_dtype) - unused * expert_bytes(s, weight_dtype)
