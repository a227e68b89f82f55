"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.distributed.parallel_state import tp_all_gather, tp_all_reduce, tp_rank, tp_size
from fulcrum.errors import WeightShapeError
from fulcrum.quant.base import UnquantizedLinearMethod


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.per_rank = -(-vocab_size // self.tp_size)
        self.start = self.per_rank * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.takes_gguf_raw = tp_size() == 1  # a GGUF table's blocks, kept (finish_gguf_table)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape[1:]) != tuple(param.shape[1:]) or loaded.shape[0] != self.vocab_size:
            raise WeightShapeError((self.vocab_size, *param.shape[1:]), tuple(loaded.shape))
        if not isinstance(loaded, torch.Tensor):  # a GGUF tensor's blocks: converted once loading is done
            self._gguf_raw = loaded
            return
        part = loaded[self.start : self.start + self.per_rank]
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def share_quantized_table(self, head: ParallelLMHead) -> None:
        """Tied embeddings with a quantized LM head: look rows up in the head's packed table (dequantizing only
        the rows of the step's tokens) and free this full-precision copy."""
        object.__setattr__(self, "_quantized_head", head)  # not a submodule: the head is the model's already
        self.out_dtype = self.weight.dtype
        del self.weight

    def finish_gguf_table(self) -> None:
        """A GGUF table in blocks that no quantized LM head shares (an untied file): converted into this layer's
        own quantized table (fulcrum.quant.gguf), whose rows lookups dequantize."""
        raw = self.__dict__.pop("_gguf_raw", None)
        if raw is None or hasattr(self, "_quantized_head"):
            return
        from fulcrum.quant.gguf import merge_parts, part_of

        self.out_dtype = self.weight.dtype
        (self.gguf_table,) = merge_parts([part_of(raw, self.weight.dtype)])
        del self.weight

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        head = getattr(self, "_quantized_head", None)
        table = getattr(self, "gguf_table", None)
        if table is not None:
            return table.dequantize(ids.reshape(-1)).to(self.out_dtype).reshape(*ids.shape, -1)
        if head is None:
            return F.embedding(ids, self.weight)
        flat = ids.reshape(-1)
        return head.quant_method.dequantize_rows(head, flat).to(self.out_dtype).reshape(*ids.shape, -1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(ids)
        local = ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        y = self._lookup(local.clamp(0, self.per_rank - 1)) * mask.unsqueeze(-1)
        return tp_all_reduce(y)


# the head's method when it is not quantized (stateless; the packed weight lives on the head)
DENSE = UnquantizedLinearMethod()


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the given hidden states; with tied embeddings the weight is the embedding's. A `quant_method`
    (fulcrum.quant) quantizes it after loading (or loads it as a quantized checkpoint stores it); a tied embedding
    then looks its rows up in the packed table."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None, quant_method=None):
        super().__init__(vocab_size, hidden_size, dtype)
        if quant_method is not None:
            self.quant_method = quant_method
            if getattr(quant_method, "from_checkpoint", False):  # the checkpoint stores the head quantized
                del self.weight
                quant_method.create_weights(self, hidden_size, [self.per_rank], dtype or torch.get_default_dtype())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # unquantized: the GEMV for few rows, oneDNN's packed copy of the weight for many on AMX (finish_loading)
        method = getattr(self, "quant_method", None) or DENSE
        logits = method.apply(self, hidden, None)
        if self.tp_size > 1:
            logits = tp_all_gather(logits)
        return logits[..., : self.vocab_size]
