"""Linear layers with two seams: a `quant_method` that owns the weight format and the matmul, and
tensor-parallel shapes (column-parallel splits outputs, row-parallel splits inputs), as in vLLM.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that takes a full
checkpoint tensor, cuts this rank's slice, and copies it into the right place of a stacked weight.
"""

from __future__ import annotations

import torch
from torch import nn

from fulcrum.distributed.parallel_state import tp_all_gather, tp_all_reduce, tp_rank, tp_size
from fulcrum.errors import WeightShapeError
from fulcrum.quant.base import LinearMethod, UnquantizedLinearMethod


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise WeightShapeError(dst.shape, src.shape)
    dst.copy_(src)


def divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by the tensor-parallel size {d}")
    return n // d


class LinearBase(nn.Module):
    """`tp_dim` is the weight dimension split across ranks: 0 for column-parallel, 1 for row-parallel."""

    tp_dim: int | None = None

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        quant_method: LinearMethod | None = None,
    ):
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.input_size = input_size
        self.output_sizes = output_sizes
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, output_sizes, dtype)
        self.lora = None  # LoRA adapter slots (layers/lora.py), when the engine serves adapters
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(output_sizes), dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_dim is not None and self.tp_dim < loaded.dim() and self.tp_size > 1:
            loaded = loaded.chunk(self.tp_size, self.tp_dim)[self.tp_rank]
        copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora.add_to(x, y)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; `gather_output` reassembles them."""

    tp_dim = 0

    def __init__(self, input_size: int, output_size: int, gather_output: bool = False, **kw):
        self.gather_output = gather_output
        super().__init__(input_size, [divide(output_size, tp_size())], **kw)

    def forward(self, x):
        y = super().forward(x)
        return tp_all_gather(y) if self.gather_output and self.tp_size > 1 else y


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections stacked into one matmul (gate and up)."""

    tp_dim = 0

    def __init__(self, input_size: int, output_sizes: list[int], **kw):
        super().__init__(input_size, [divide(s, tp_size()) for s in output_sizes], **kw)

    def weight_loader(self, param, loaded, shard_id: int | None = None):
        if shard_id is None:
            return super().weight_loader(param, loaded)
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        loaded = loaded.chunk(self.tp_size, 0)[self.tp_rank]
        copy_checked(param.data.narrow(0, offset, size), loaded)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul; KV heads are replicated when there are fewer than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, **kw):
        tp = tp_size()
        self.num_heads = divide(num_heads, tp)
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        self.head_dim = head_dim
        sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        LinearBase.__init__(self, hidden_size, sizes, **kw)

    def weight_loader(self, param, loaded, shard_id: str | None = None):
        if shard_id is None:
            return LinearBase.weight_loader(self, param, loaded)
        idx = "qkv".index(shard_id)
        size = self.output_sizes[idx]
        offset = sum(self.output_sizes[:idx])
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        loaded = loaded.narrow(0, rank * size, min(size, loaded.shape[0])) if self.tp_size > 1 else loaded
        copy_checked(param.data.narrow(0, offset, size), loaded)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    tp_dim = 1

    def __init__(self, input_size: int, output_size: int, bias: bool = False, **kw):
        super().__init__(divide(input_size, tp_size()), [output_size], bias=bias, **kw)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias: added once, on rank 0 only
            if self.tp_rank != 0:
                loaded = torch.zeros_like(loaded)
            return copy_checked(param.data, loaded)
        return super().weight_loader(param, loaded)

    def forward(self, x):
        # the layer's own size, not the process's: a model built unsplit (a draft beside a parallel target) never
        # meets the other ranks
        y = super().forward(x)
        return tp_all_reduce(y) if self.tp_size > 1 else y
