"""The Llama family: Llama 1/2/3, Mistral, Qwen2 (QKV bias) and Qwen3 (per-head q/k RMSNorm).

They differ only in a few switches, so one set of modules serves them all; a family is a subclass
that sets its switches. Forward takes flattened tokens: input_ids [T], positions [T].
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from fulcrum.config import rope_parameters
from fulcrum.distributed import parallel_state
from fulcrum.distributed.parallel_state import layer_range
from fulcrum.kernels import cpu_decode_stack
from fulcrum.kernels import triton as triton_kernels
from fulcrum.kernels.cpu_decode_stack import DecodeStack, LayerTensors
from fulcrum.layers import lora
from fulcrum.layers.activation import SiluAndMul
from fulcrum.layers.attention import Attention, AttentionMetadata
from fulcrum.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from fulcrum.layers.layernorm import RMSNorm
from fulcrum.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from fulcrum.layers.rotary import RotaryEmbedding
from fulcrum.model_folder.hf_config import head_dim as config_head_dim
from fulcrum.model_folder.hf_config import layer_sliding_windows


class LlamaAttention(nn.Module):
    """The switches are keyword-only: biases on the fused q/k/v and on o, a norm on q and k (Qwen3's; `norm` its class),
    and Gemma's `scale` (default head_dim ** -0.5) and `logit_softcap`."""

    @classmethod
    def of_family(cls, cfg: PretrainedConfig, layer_idx: int, family: type[LlamaForCausalLM], dtype, quant):
        """The attention of a Llama-family layer, with the switches its family sets (biases, the q/k norm)."""
        return cls(cfg, layer_idx, dtype, quant, qkv_bias=family.qkv_bias(cfg), o_bias=family.o_bias(cfg),
                   qk_norm=family.qk_norm)  # fmt: skip

    def __init__(
        self, cfg: PretrainedConfig, layer_idx: int, dtype, quant, *, qkv_bias: bool = False, o_bias: bool = False,
        qk_norm: bool = False, scale: float | None = None, logit_softcap: float | None = None,
        norm: type[nn.Module] = RMSNorm,
    ):  # fmt: skip
        super().__init__()
        hd = config_head_dim(cfg)
        prefix = f"model.layers.{layer_idx}.self_attn"  # the checkpoint's module names, which quant matches
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads, bias=qkv_bias, dtype=dtype,
            quant_method=quant(f"{prefix}.qkv_proj"),
        )  # fmt: skip
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * hd, cfg.hidden_size, bias=o_bias, dtype=dtype,
            quant_method=quant(f"{prefix}.o_proj"),
        )  # fmt: skip
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, hd, hd**-0.5 if scale is None else scale,
            sliding_window=layer_sliding_windows(cfg)[layer_idx], logit_softcap=logit_softcap,
        )  # fmt: skip
        if qk_norm:
            self.q_norm = norm(hd, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = norm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.qk_norm = qk_norm

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        o = self.attn(q, k, v, meta, rope)  # rotary applied there, fused with the KV-cache write on CPU
        return self.o_proj(o.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    """`act` takes the stacked [gate, up] to act(gate) * up: SwiGLU's unless another is given (Gemma's GELU)."""

    def __init__(self, cfg: PretrainedConfig, bias: bool, dtype, quant, prefix: str, act: nn.Module | None = None):
        super().__init__()
        if act is None and getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter, inter], bias=bias, dtype=dtype, quant_method=quant(f"{prefix}.gate_up_proj")
        )
        self.down_proj = RowParallelLinear(
            inter, cfg.hidden_size, bias=bias, dtype=dtype, quant_method=quant(f"{prefix}.down_proj")
        )
        self.act = SiluAndMul() if act is None else act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, layer_idx: int, family: type[LlamaForCausalLM], dtype, quant):
        super().__init__()
        self.self_attn = LlamaAttention.of_family(cfg, layer_idx, family, dtype, quant)
        self.mlp = LlamaMLP(cfg, getattr(cfg, "mlp_bias", False), dtype, quant, f"model.layers.{layer_idx}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, rope, x, meta):
        h = self.self_attn(rope, self.input_layernorm(x), meta)
        norm = self.post_attention_layernorm
        if type(norm) is RMSNorm and triton_kernels.usable(x):  # the residual add and the norm in one kernel
            from fulcrum.kernels.triton import rms_norm

            h, x = rms_norm.rms_norm(h, norm.weight, norm.eps, residual=x)  # x += h in place
            return x + self.mlp(h)
        x = x + h
        return x + self.mlp(norm(x))


def fused_decode_stack(layers: list[nn.Module]) -> DecodeStack | None:
    """The decode-stack plan of Llama-shaped layers (RMSNorms, fused QKV with rope, paged attention, SwiGLU MLP),
    with weights the stack reads (dense, or quantized in a layout the qgemv kernels take: the methods'
    decode_stack_weight) on one tensor-parallel rank; None for anything else (split weights, q/k norms, other layer
    classes), which keeps the modules."""
    if not layers or any(type(x) is not LlamaDecoderLayer for x in layers):
        return None
    tensors = []
    for x in layers:
        sa, mlp = x.self_attn, x.mlp
        linears = (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (x.input_layernorm, x.post_attention_layernorm)
        if (
            sa.qk_norm
            or type(mlp.act) is not SiluAndMul
            or any(type(n) is not RMSNorm or n.eps != norms[0].eps for n in norms)
            or any(lin.tp_size != 1 or lin.quant_method.decode_stack_weight(lin) is None for lin in linears)
            or sa.attn.k_cache is None
        ):
            return None
        tensors.append(
            LayerTensors(
                x.input_layernorm.weight,
                sa.qkv_proj.quant_method.decode_stack_weight(sa.qkv_proj),
                sa.qkv_proj.bias,
                sa.o_proj.quant_method.decode_stack_weight(sa.o_proj),
                sa.o_proj.bias,
                x.post_attention_layernorm.weight,
                mlp.gate_up_proj.quant_method.decode_stack_weight(mlp.gate_up_proj),
                mlp.gate_up_proj.bias,
                mlp.down_proj.quant_method.decode_stack_weight(mlp.down_proj),
                mlp.down_proj.bias,
                sa.attn.k_cache,
                sa.attn.v_cache,
                sa.attn.k_scales,
                sa.attn.v_scales,
                sa.attn.scale,
                sa.attn.sliding_window,
                tuple((lin.lora.a, lin.lora.bt) for lin in linears) if all(lin.lora for lin in linears) else None,
                tuple(lin.packed_weight for lin in linears)
                if all(getattr(lin, "packed_weight", None) is not None for lin in linears)
                else None,
                tuple(lin.small_weight for lin in linears)
                if all(getattr(lin, "small_weight", None) is not None for lin in linears)
                else None,
            )  # fmt: skip
        )
    a = layers[0].self_attn
    eps, softcaps = layers[0].input_layernorm.eps, {x.self_attn.attn.logit_softcap for x in layers}
    if len(softcaps) > 1 or any(x.input_layernorm.eps != eps for x in layers):
        return None
    if not DecodeStack.supported(tensors, a.head_dim, a.num_heads // a.num_kv_heads):
        return None
    return DecodeStack(tensors, a.num_heads, a.num_kv_heads, a.head_dim, eps, softcaps.pop())


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no weights here, and never run."""


class LlamaModel(nn.Module):
    """The decoder stack: embedding, `family.decoder_layer`s, final norm, one rope table for all layers. Under
    pipeline parallelism it builds only its stage's layers (the others are MissingLayer, so the checkpoint's layer
    numbers still name them), the embedding on the first stage (and on the last when the LM head is tied to it),
    the final norm on the last. A family changes `embed` (Gemma scales it) or `ropes` (Gemma has two tables)."""

    def __init__(self, cfg: PretrainedConfig, family: type[LlamaForCausalLM], dtype, quant):
        super().__init__()
        n = cfg.num_hidden_layers
        self.start, self.end = layer_range(n)
        ps = parallel_state.state()
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = None
        if ps.is_first_stage or (tied and ps.is_last_stage):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            family.decoder_layer(cfg, i, family, dtype, quant) if self.start <= i < self.end else MissingLayer()
            for i in range(n)
        )
        self.norm = family.final_norm(cfg, dtype) if ps.is_last_stage else None
        self.rotary_emb = family.rotary(cfg)
        self.first_stage = ps.is_first_stage
        self._stack: DecodeStack | None | bool = None  # the fused decode plan; False: these layers do not fit it
        self.fused_decode = cpu_decode_stack.enabled()  # off: decode steps run the modules (--enforce-eager)

    def local_layers(self) -> list[nn.Module]:
        return list(self.layers[self.start : self.end])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.rotary_emb(positions, dtype)  # one lookup for all layers

    def forward(self, input_ids, positions, meta, hidden: torch.Tensor | None = None, image_rows=None):
        """`hidden`: the previous pipeline stage's output, in place of the embedding after the first stage.
        `image_rows` (rows, embeddings): a vision-language prompt's image tokens, whose rows take the image's."""
        x = self.embed(input_ids) if self.first_stage else hidden
        if image_rows is not None and self.first_stage:
            x = x.index_copy(0, image_rows[0], image_rows[1].to(x.dtype))
        rope = self.ropes(positions, x.dtype)
        stack = self._decode_stack(meta, x)
        if stack is not None:  # a decode-only step: every layer in one call, the same kernels the modules call
            x = stack.run(x, rope[0], rope[1], meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                          lora.token_slots())  # fmt: skip
        else:
            for layer in self.layers[self.start : self.end]:
                x = layer(rope, x, meta)
        return x if self.norm is None else self.norm(x)

    def _decode_stack(self, meta: AttentionMetadata, x: torch.Tensor) -> DecodeStack | None:
        """The fused plan when this step can take it: decodes only, few enough rows, and layers that fit (built at
        the first such step, once the cache is attached; again if the cache moved)."""
        if (
            not self.fused_decode
            or x.device.type != "cpu"  # a C++ driver of CPU kernels (and nothing a CUDA graph may capture)
            or triton_kernels.usable(x)  # the Triton kernels forced on CPU: the layers run them
            or self._stack is False
            or meta.prefills
            or meta.decode_token_idx is None
            or meta.slot_mapping is None
        ):
            return None
        if self._stack is None or self._stack.cache_ptr != self.layers[self.start].self_attn.attn.k_cache.data_ptr():
            self._stack = fused_decode_stack(self.local_layers()) or False
            if self._stack is False:
                return None
        if not 0 < x.shape[0] <= self._stack.max_rows or x.dtype != self._stack.dtype:
            return None
        if lora.active() and not self._stack.lora_rank:  # a stack built without the layers' adapter slots
            return None
        return self._stack


def from_checkpoint(head) -> bool:
    """Whether the LM head loads its own tensor as the checkpoint stores it (a GGUF file's blocks)."""
    return getattr(getattr(head, "quant_method", None), "from_checkpoint", False)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our stacked parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False
    base_model_class: type[nn.Module] = LlamaModel  # the decoder stack under the LM head
    decoder_layer: type[nn.Module] = LlamaDecoderLayer

    @staticmethod
    def final_norm(cfg, dtype) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    @staticmethod
    def rotary(cfg) -> nn.Module:
        return RotaryEmbedding(config_head_dim(cfg), cfg.max_position_embeddings, rope_parameters(cfg))

    @staticmethod
    def qkv_bias(cfg) -> bool:
        return bool(getattr(cfg, "attention_bias", False))

    @staticmethod
    def o_bias(cfg) -> bool:
        return bool(getattr(cfg, "attention_bias", False))

    def __init__(self, cfg: PretrainedConfig, dtype: torch.dtype | None = None, quant=None):
        """`quant(prefix)`: each linear layer's quant_method, given its checkpoint name ("lm_head",
        "model.layers.0.mlp.gate_up_proj"), or None for full precision; see fulcrum.quant."""
        super().__init__()
        quant = quant or (lambda prefix: None)
        self.config = cfg
        self.model = self.base_model_class(cfg, type(self), dtype, quant)
        self.lm_head = None  # on the last pipeline stage only
        if parallel_state.state().is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, quant_method=quant("lm_head"))
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # a head that loads as its file stores it (a GGUF's blocks) takes the embedding's tensor into its own format,
        # and the embedding then reads its rows from the head (after_loading)
        if self.tie_word_embeddings and self.lm_head is not None and not from_checkpoint(self.lm_head):
            self.lm_head.weight = self.model.embed_tokens.weight

    def skip_weight(self, name: str) -> bool:
        """Checkpoint tensors of what another pipeline stage holds: its layers, the embedding, norm or LM head."""
        if name.startswith("model.layers."):
            index = name.split(".")[2]
            return (
                index.isdigit()
                and int(index) < len(self.model.layers)
                and not (self.model.start <= int(index) < self.model.end)
            )
        held = {
            "model.embed_tokens.": self.model.embed_tokens,
            "model.norm.": self.model.norm,
            "lm_head.": self.lm_head,
        }
        return any(name.startswith(prefix) and module is None for prefix, module in held.items())

    def after_loading(self) -> None:
        """Once the weights are loaded (and quantized): a tied embedding reads the quantized LM head's table."""
        if self.tie_word_embeddings and self.lm_head is not None and not hasattr(self.lm_head, "weight"):
            self.model.embed_tokens.share_quantized_table(self.lm_head)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, hidden=None, image_rows=None
    ) -> torch.Tensor:
        """Final hidden states for every token: [T, hidden] (before the last pipeline stage, that stage's output;
        after the first, `hidden` is the previous stage's)."""
        return self.model(input_ids, positions, meta, hidden, image_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with sliding-window attention (taken from config.sliding_window)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_bias(cfg) -> bool:
        return True

    @staticmethod
    def o_bias(cfg) -> bool:
        return False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
