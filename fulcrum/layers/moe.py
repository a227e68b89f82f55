"""Mixture of experts: a router picks each token's top-k experts and weighs them, and the experts run grouped (the
token slots sorted by expert, one GEMM pair per expert that some token chose), their weights stacked at load time
into [num_experts, ...] tensors from the checkpoint's one tensor per expert. One layer serves Mixtral, Qwen2/3-MoE
and DeepSeek V2/V3, their routing told apart by switches (`select_experts`, `TopKRouter`).
"""

from __future__ import annotations

import torch
from torch import nn

from fulcrum.distributed.parallel_state import expert_parallel, tp_all_reduce, tp_rank, tp_size
from fulcrum.errors import ModelLoadError, WeightLoadError, WeightShapeError
from fulcrum.kernels import cpu_gemv
from fulcrum.kernels import triton as triton_kernels
from fulcrum.layers.activation import SiluAndMul
from fulcrum.layers.linear import LinearBase, divide
from fulcrum.quant import formats, fp8_block

SCORING_FUNCS = ("softmax", "sigmoid")


def select_experts(
    logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = False,
    n_group: int | None = None, topk_group: int | None = None, correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]), in transformers' order of steps.
    The switches cover the families that share this layer: Mixtral (softmax, top-k renormalised), Qwen2/3-MoE
    (softmax, renormalised when norm_topk_prob), DeepSeek V2 (softmax, greedy or group-limited) and V3 (sigmoid, a
    score-correction bias, grouped top-k), DeepSeek's with routed_scaling_factor.

    Scores are softmax or sigmoid of the logits in float32. The correction bias (DeepSeek V3) is added to the scores
    for choosing only; the weights are the unbiased scores of the chosen experts. Grouped top-k (n_group groups of
    E / n_group experts) keeps the topk_group best groups of each token and chooses among their experts: a group
    scores its best expert, or with a correction bias the sum of its best two (V2's group_limited_greedy and V3's
    noaux_tc, as vLLM tells them apart). Renormalised weights sum to 1 (the 1e-20 of DeepSeek's divisor is below
    an fp32 ulp of any sum of scores, so it changes no other family's weights); then routed_scaling_factor."""
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"scoring function {scoring!r} is not supported; supported: {', '.join(SCORING_FUNCS)}")
    logits = logits.float()
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if n_group is not None and n_group > 1 and (topk_group or n_group) < n_group:
        tokens, experts = choice.shape
        groups = choice.view(tokens, n_group, experts // n_group)
        group_scores = groups.max(-1).values if correction_bias is None else groups.topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, -1).indices, True)
        choice = groups.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)
    ids = choice.topk(top_k, -1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


class TopKRouter(nn.Module):
    """The gate: logits = x W^T (W [num_experts, hidden], the checkpoint's `gate.weight`, never quantized), then
    select_experts. `logits_fp32` keeps W in float32 and takes x to float32 first (DeepSeek); otherwise the logits
    are in the model's dtype, as Mixtral's and Qwen's gates compute them."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, *, scoring: str = "softmax", renormalize: bool = False,
        n_group: int | None = None, topk_group: int | None = None, routed_scaling_factor: float = 1.0,
        correction_bias: bool = False, logits_fp32: bool = False, dtype: torch.dtype | None = None,
    ):  # fmt: skip
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        if n_group and num_experts % n_group:
            raise ValueError(f"num_experts {num_experts} is not divisible by n_group {n_group}")
        if scoring not in SCORING_FUNCS:
            raise ValueError(f"scoring function {scoring!r} is not supported; supported: {', '.join(SCORING_FUNCS)}")
        self.top_k, self.scoring, self.renormalize = top_k, scoring, renormalize
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.logits_fp32 = logits_fp32
        w_dtype = torch.float32 if logits_fp32 else (dtype or torch.get_default_dtype())
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=w_dtype), requires_grad=False)
        self.e_score_correction_bias = None
        if correction_bias:  # the checkpoint's `gate.e_score_correction_bias`, kept in float32 as transformers does
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = cpu_gemv.linear(x.float() if self.logits_fp32 else x, self.weight)
        return select_experts(
            logits, self.top_k, scoring=self.scoring, renormalize=self.renormalize, n_group=self.n_group,
            topk_group=self.topk_group, correction_bias=self.e_score_correction_bias,
            routed_scaling_factor=self.routed_scaling_factor,
        )  # fmt: skip


class StackedExpertWeight(nn.Module):
    """One projection of every expert, stacked: weight [num_experts, sum(output_sizes), input_size], filled from the
    checkpoint's per-expert tensors (loader shard id (expert, part): part indexes output_sizes, gate 0 and up 1).
    `tp_dim` 0 splits each part's rows across tensor-parallel ranks (gate/up), 1 the input columns (down). Under
    expert parallelism (`experts`, this rank's [first, last) of them) each rank holds its experts whole instead.

    From a block-wise fp8 checkpoint (`block`, its weight_block_size) the weight loads as float8_e4m3fn and
    `weight_scale_inv` its tile scales widened to one per row and block of inputs, [E, rows, ceil(I / b1)]; once
    loaded they go block-major (`qweight`, `scales`: fulcrum.quant.fp8_block.BlockFp8Experts). `linear(x, e)` is
    expert e's GEMM either way."""

    def __init__(
        self, num_experts: int, input_size: int, output_sizes: list[int], tp_dim: int, dtype,
        experts: tuple[int, int] | None = None, block: tuple[int, int] | None = None,
    ):  # fmt: skip
        super().__init__()
        self.tp_dim, self.tp_rank, self.tp_size = tp_dim, tp_rank(), tp_size()
        self.experts = experts or (0, num_experts)
        split = 1 if experts is not None else self.tp_size  # whole experts, or a slice of every one
        self.split = split
        self.full_shapes = [(size, input_size) for size in output_sizes]  # one expert's checkpoint tensor per part
        self.output_sizes = [divide(s, split) for s in output_sizes] if tp_dim == 0 else list(output_sizes)
        local_input = divide(input_size, split) if tp_dim == 1 else input_size
        local_experts = self.experts[1] - self.experts[0]
        self.block = block
        self.weight = nn.Parameter(
            torch.empty(
                local_experts, sum(self.output_sizes), local_input, dtype=torch.float8_e4m3fn if block else dtype
            ),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader
        if block:
            if tp_dim == 1 and split > 1 and local_input % block[1]:
                raise ModelLoadError(
                    f"tensor parallel {split} splits the experts' {input_size} inputs into {local_input} per rank, not "
                    f"a multiple of the checkpoint's fp8 block of {block[1]} inputs; use a size that divides the blocks"
                )
            blocks = -(-local_input // block[1])
            self.weight_scale_inv = nn.Parameter(
                torch.empty(local_experts, sum(self.output_sizes), blocks, dtype=torch.float32), requires_grad=False
            )
            self.weight_scale_inv.weight_loader = self.scale_loader
            self.quant_method = fp8_block.BlockFp8Experts(block)  # block-major once loaded (finish_loading)

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int] | None = None) -> None:
        rows, cols = self.full_shapes[shard[1]] if shard is not None else (0, 0)
        expected = (-(-rows // self.block[0]), -(-cols // self.block[1]))
        if shard is not None and tuple(loaded.shape) != expected:  # one scale per [b0, b1] tile
            raise WeightShapeError(expected, tuple(loaded.shape))
        self.weight_loader(param, formats.fp8_block_rows(loaded, self.block[0], rows), shard, (rows, expected[1]))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int] | None = None, full=None
    ) -> None:
        if shard is None:
            raise WeightLoadError(
                f"a stacked tensor {tuple(loaded.shape)} for all experts; fulcrum loads one tensor per expert "
                "(experts.<e>.<proj>.weight, as transformers saves them)"
            )
        expert, part = shard
        full = full or self.full_shapes[part]
        if tuple(loaded.shape) != full:  # checked whole, before a rank's slice hides the size
            raise WeightShapeError(full, tuple(loaded.shape))
        if param.dtype == torch.float8_e4m3fn and loaded.dtype != param.dtype:
            raise WeightLoadError(f"dtype {loaded.dtype}, a block-wise fp8 checkpoint stores it as float8_e4m3fn")
        first, last = self.experts
        if not first <= expert < last:
            return  # another expert-parallel rank's
        if self.split > 1:
            loaded = loaded.chunk(self.split, self.tp_dim)[self.tp_rank]
        offset = sum(self.output_sizes[:part])
        param.data[expert - first].narrow(0, offset, self.output_sizes[part]).copy_(loaded)

    def linear(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """x @ W^T with local expert `index`'s weight W [rows, inputs]."""
        if self.block is None:
            return cpu_gemv.linear(x, self.weight[index])
        return fp8_block.block_linear(x, self.qweight[index], self.scales[index])

    def expert(self, index: int) -> torch.Tensor:
        """Local expert `index`'s weight [rows, inputs], fp8 ones widened to fp32 (a reference for tests)."""
        if self.block is None:
            return self.weight[index]
        return fp8_block.widen_blocks(self.qweight[index], self.scales[index], torch.float32)[:, : self.input_size]


class FusedExperts(nn.Module):
    """Every routed expert's SwiGLU MLP, stacked: gate_up_proj.weight [E, 2 * I, H] and down_proj.weight [E, H, I]
    (transformers' own names for its stacked experts, each holding one module's weight here).

    Under tensor parallelism each rank holds a slice of every expert's intermediate dimension; with expert parallelism
    (`--enable-expert-parallel`) it holds num_experts / tp experts whole and computes only the slots routed to them.
    Every rank has every token (attention's all-reduce left them replicated), so no dispatch is needed: each computes
    its experts' share and the block's all-reduce sums the shares, as it sums the slices under plain TP."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype=None,
        block: tuple[int, int] | None = None,
    ):
        """`block`: a block-wise fp8 checkpoint's weight_block_size (fulcrum.quant.expert_format), None for full
        precision."""
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        self.num_experts = num_experts
        self.local = None  # expert parallel: this rank's experts [first, last)
        if expert_parallel():
            if num_experts < tp_size():
                raise ValueError(f"expert parallelism over {tp_size()} ranks needs as many experts, not {num_experts}")
            base, extra = divmod(num_experts, tp_size())
            first = tp_rank() * base + min(tp_rank(), extra)
            self.local = (first, first + base + (tp_rank() < extra))
        self.gate_up_proj = StackedExpertWeight(
            num_experts, hidden_size, [intermediate_size, intermediate_size], 0, dtype, self.local, block
        )
        self.down_proj = StackedExpertWeight(num_experts, intermediate_size, [hidden_size], 1, dtype, self.local, block)
        self.block = block
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> sum over each token's k experts of weight * expert(x), [T, H] (under
        tensor parallelism this rank's partial sum, which the caller all-reduces)."""
        if triton_kernels.usable(x) and self.local is None and self.block is None:
            # both GEMMs as grouped Triton kernels over the expert-sorted slots, with no host sync (CUDA graphs)
            from fulcrum.kernels.triton import moe as triton_moe

            w13, w2 = self.gate_up_proj.weight, self.down_proj.weight
            return triton_moe.fused_experts(x, w13, w2, topk_weights, topk_ids, self.act)
        tokens, k = topk_ids.shape
        flat = topk_ids.flatten()
        order = flat.argsort(stable=True)  # the T * k (token, choice) slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync: the GEMM sizes
        xs = x[order // k]  # each sorted slot's token
        slot_weights = topk_weights.flatten()[order, None]
        first, last = self.local or (0, self.num_experts)
        ys = torch.empty_like(xs) if self.local is None else torch.zeros_like(xs)  # others' slots add nothing here
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            end = start + n
            if not first <= expert < last:
                start = end
                continue
            local = expert - first
            h = self.down_proj.linear(self.act(self.gate_up_proj.linear(xs[start:end], local)), local)
            ys[start:end] = h * slot_weights[start:end]  # the float32 weight, rounded with the product
            start = end
        # back to (token, choice) order; a token's k contributions summed in float32 and rounded once (index_add_
        # into the tokens' rows runs as a slow scatter_add_ on CPU)
        ys = ys.index_select(0, order.argsort())
        return ys.view(tokens, k, x.shape[1]).sum(1, dtype=torch.float32).to(x.dtype)


def expert_params_mapping(num_experts: int, gate: str, up: str, down: str, prefix: str = "experts") -> dict:
    """The loader's packed_modules_mapping entries that stack each expert's checkpoint tensors into FusedExperts:
    `{prefix}.{e}.{gate}` -> (`{prefix}.gate_up_proj`, (e, 0)), up -> part 1, down -> `{prefix}.down_proj`. A model
    puts them before its dense entries, which match first otherwise (an expert's `.gate_proj.` is a dense name)."""
    out = {}
    for e in range(num_experts):
        out[f"{prefix}.{e}.{gate}"] = (f"{prefix}.gate_up_proj", (e, 0))
        out[f"{prefix}.{e}.{up}"] = (f"{prefix}.gate_up_proj", (e, 1))
        out[f"{prefix}.{e}.{down}"] = (f"{prefix}.down_proj", (e, 0))
    return out


class SparseMoeBlock(nn.Module):
    """Router (`gate`) + grouped routed experts (`experts`), plus an always-on shared expert, registered under the
    checkpoint's name for it (Qwen2-MoE's `shared_expert`, DeepSeek's `shared_experts`); with `shared_expert_gate`
    its output is scaled by sigmoid(x w) first (Qwen2-MoE's `shared_expert_gate.weight` [1, hidden])."""

    def __init__(
        self, gate: TopKRouter, experts: FusedExperts, shared_expert: nn.Module | None = None,
        shared_expert_name: str = "shared_expert", shared_expert_gate: bool = False, dtype=None,
    ):  # fmt: skip
        super().__init__()
        self.tp_size = tp_size()
        self.gate, self.experts = gate, experts
        self.shared_expert_name = shared_expert_name if shared_expert is not None else None
        if shared_expert is not None:
            self.add_module(shared_expert_name, shared_expert)
        self.shared_expert_gate = None
        if shared_expert_gate:
            if shared_expert is None:
                raise ValueError("a shared expert gate needs a shared expert")
            hidden = gate.weight.shape[1]
            self.shared_expert_gate = LinearBase(hidden, [1], bias=False, dtype=dtype)  # replicated, full precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.tp_size > 1:  # the shares of the ranks (the block's own size: see RowParallelLinear.forward)
            out = tp_all_reduce(out)
        if self.shared_expert_name is not None:
            shared = getattr(self, self.shared_expert_name)(x)  # its down projection all-reduces on its own
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
