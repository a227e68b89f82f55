"""gpt-oss (GptOssForCausalLM): Llama's stack with biases on q/k/v/o, a learned attention sink per head, sliding and
full attention layers as config.layer_types alternates them, YaRN rope, and a mixture of experts in every layer: a
router with a bias whose top-k logits are softmaxed (over the chosen only), experts with biases and a clamped SwiGLU
((up + 1) * gate * sigmoid(alpha * gate), gate clamped above and up on both sides at swiglu_limit) whose gate and
up rows are interleaved (gate the even rows). The released experts are MXFP4 (fulcrum.quant.mxfp4) and stay so:
the kernel reads the 4-bit values and their exponents (fulcrum.kernels.cpu_mxfp4 through mxfp4.linear); a dense checkpoint (as
transformers saves one, [E, in, out]) loads as well."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from fulcrum.distributed.parallel_state import tp_rank, tp_size
from fulcrum.errors import ModelLoadError, WeightShapeError
from fulcrum.kernels import cpu_gemv
from fulcrum.layers.attention import AttentionMetadata
from fulcrum.layers.layernorm import RMSNorm
from fulcrum.layers.linear import copy_checked
from fulcrum.models.llama import LlamaAttention, LlamaForCausalLM
from fulcrum.quant import mxfp4


def is_mxfp4(cfg: PretrainedConfig) -> bool:
    return str((getattr(cfg, "quantization_config", None) or {}).get("quant_method", "")).lower() == "mxfp4"


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[T, 2I] with gate and up interleaved -> [T, I], as GptOssExperts computes it."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssAttention(LlamaAttention):
    """Llama's attention with its biases and the checkpoint's `sinks` [num_heads] (this rank's heads under TP)."""

    def __init__(self, cfg: PretrainedConfig, layer_idx: int, dtype, quant):
        bias = bool(getattr(cfg, "attention_bias", True))
        super().__init__(cfg, layer_idx, dtype, quant, qkv_bias=bias, o_bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        self.attn.sinks = self.sinks.data  # a view the attention reads; the parameter is loaded in place

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_checked(param.data, loaded.chunk(tp_size())[tp_rank()] if tp_size() > 1 else loaded)


class GptOssRouter(nn.Module):
    """logits = x W^T + b; the top-k logits' softmax, in the model's dtype as transformers computes it."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, dtype):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = F.linear(x, self.weight, self.bias).topk(self.top_k, -1)
        return top.softmax(-1), ids


class GptOssExperts(nn.Module):
    """Every expert's gate_up [E, 2I, H] and down [E, H, I] projections, held as MXFP4 `*_blocks`/`*_scales` under
    the checkpoint's names, or dense (`gate_up_proj`, `down_proj`, transposed at load from transformers' [E, in,
    out]), and their biases. Runs grouped by expert, as FusedExperts does."""

    def __init__(self, cfg: PretrainedConfig, dtype, quantized: bool):
        super().__init__()
        if tp_size() > 1:
            raise ModelLoadError("gpt-oss experts are not split across tensor-parallel ranks yet (use --tp 1)")
        n, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        if quantized and (h % mxfp4.BLOCK or i % mxfp4.BLOCK):
            raise ModelLoadError(f"MXFP4 experts need hidden and intermediate sizes in blocks of {mxfp4.BLOCK}")
        self.num_experts, self.quantized = n, quantized
        self.alpha, self.limit = float(cfg.swiglu_alpha), float(cfg.swiglu_limit)
        dtype = dtype or torch.get_default_dtype()

        def param(*shape, dt=dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dt), requires_grad=False)

        for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            if quantized:
                setattr(self, f"{name}_blocks", param(n, rows, cols // mxfp4.BLOCK, mxfp4.BLOCK // 2, dt=torch.uint8))
                setattr(self, f"{name}_scales", param(n, rows, cols // mxfp4.BLOCK, dt=torch.uint8))
            else:
                weight = param(n, rows, cols)
                weight.weight_loader = self._load_transposed
                setattr(self, name, weight)
        self.gate_up_proj_bias = param(n, 2 * i)
        self.down_proj_bias = param(n, h)

    @staticmethod
    def _load_transposed(param: nn.Parameter, loaded: torch.Tensor) -> None:
        expected = (param.shape[0], param.shape[2], param.shape[1])
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(expected, tuple(loaded.shape))
        param.data.copy_(loaded.transpose(1, 2))

    def _linear(self, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(self, f"{name}_bias")[expert]
        if not self.quantized:
            return cpu_gemv.linear(x, getattr(self, name)[expert], bias)
        blocks, scales = getattr(self, f"{name}_blocks")[expert], getattr(self, f"{name}_scales")[expert]
        return mxfp4.linear(x, blocks, scales, bias)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tokens, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # the T * k (token, choice) slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x[order // k]
        slot_weights = weights.flatten()[order, None]
        ys = torch.empty_like(xs)
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            end = start + n
            h = clamped_swiglu(self._linear("gate_up_proj", expert, xs[start:end]), self.alpha, self.limit)
            ys[start:end] = self._linear("down_proj", expert, h) * slot_weights[start:end]
            start = end
        ys = ys.index_select(0, order.argsort())
        return ys.view(tokens, k, x.shape[1]).sum(1, dtype=torch.float32).to(x.dtype)


class GptOssMLP(nn.Module):
    def __init__(self, cfg: PretrainedConfig, dtype):
        super().__init__()
        self.router = GptOssRouter(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, dtype)
        self.experts = GptOssExperts(cfg, dtype, is_mxfp4(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, layer_idx: int, family: type[LlamaForCausalLM], dtype, quant):
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer_idx, dtype, quant)
        self.mlp = GptOssMLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(self, rope, x, meta: AttentionMetadata):
        x = x + self.self_attn(rope, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer = GptOssDecoderLayer
