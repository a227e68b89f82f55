"""The MoE layer against transformers' own modules, on the same weights: each family's router (Mixtral, Qwen2/3-MoE,
DeepSeek V2 greedy and group-limited, DeepSeek V3's sigmoid scores with correction bias, groups and scaling) chooses
the same experts with the same weights; whole sparse blocks (Qwen2-MoE's shared expert and its gate, DeepSeek V3's
shared experts) give the same output; the grouped experts equal a float64 per-token loop; a tensor-parallel rank
takes its slice of every expert, and the ranks' partial sums add up to the whole."""

import copy

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock, Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

import fulcrum.layers.moe as moe
from fulcrum.errors import WeightLoadError, WeightShapeError
from fulcrum.layers.moe import FusedExperts, SparseMoeBlock, TopKRouter, select_experts
from fulcrum.models.llama import LlamaMLP

H = 64


def with_intermediate_size(cfg, size: int):
    """LlamaMLP takes its width from the config: a shared expert's is its own."""
    out = copy.copy(cfg)
    out.intermediate_size = size
    return out


GROUPS = dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, routed_scaling_factor=2.5)

# name -> (transformers' router, its config, our router's switches)
ROUTERS = {
    "mixtral": (MixtralTopKRouter, MixtralConfig(num_local_experts=8, num_experts_per_tok=2), dict(renormalize=True)),
    "qwen2-moe": (Qwen2MoeTopKRouter, Qwen2MoeConfig(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False), {}),
    "qwen3-moe": (
        Qwen3MoeTopKRouter,
        Qwen3MoeConfig(num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
        dict(renormalize=True),
    ),
    "deepseek-v2-greedy": (
        DeepseekV2TopkRouter,
        DeepseekV2Config(**GROUPS, topk_method="greedy"),
        dict(routed_scaling_factor=2.5, logits_fp32=True),
    ),
    "deepseek-v2-group-limited": (
        DeepseekV2TopkRouter,
        DeepseekV2Config(**GROUPS, topk_method="group_limited_greedy"),
        dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, logits_fp32=True),
    ),
    "deepseek-v3": (
        DeepseekV3TopkRouter,
        DeepseekV3Config(**GROUPS, norm_topk_prob=True),
        dict(
            scoring="sigmoid",
            renormalize=True,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            correction_bias=True,
            logits_fp32=True,
        ),
    ),  # fmt: skip
}


def _by_expert(weights, ids):
    """Each row's (id, weight) pairs in id order, so that choices compare whatever order top-k returned them in."""
    ids, order = ids.sort(-1)
    return weights.gather(-1, order), ids


def _routers(name, seed=0):
    cls, cfg, switches = ROUTERS[name]
    cfg.hidden_size = H
    theirs = cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(theirs.weight.shape, generator=g) * 0.3)
        if hasattr(theirs, "e_score_correction_bias"):
            theirs.e_score_correction_bias.copy_(torch.randn(theirs.weight.shape[0], generator=g) * 0.1)
    num_experts, top_k = theirs.weight.shape[0], cfg.num_experts_per_tok
    ours = TopKRouter(H, num_experts, top_k, dtype=torch.float32, **switches)
    ours.weight.data.copy_(theirs.weight)
    if ours.e_score_correction_bias is not None:
        ours.e_score_correction_bias.data.copy_(theirs.e_score_correction_bias)
    return ours, theirs


@pytest.mark.parametrize("name", ROUTERS)
def test_each_familys_router_chooses_and_weighs_as_transformers(name):
    ours, theirs = _routers(name)
    x = torch.randn(300, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, ref_weights, ref_ids = theirs(x)
        weights, ids = ours(x)
    assert weights.dtype == torch.float32 and ids.shape == ref_ids.shape
    w, i = _by_expert(weights, ids)
    ref_w, ref_i = _by_expert(ref_weights.float(), ref_ids)
    assert torch.equal(i, ref_i)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-6)


def test_the_deepseek_switches_change_the_choice():
    """The router tests above could not tell a switch that does nothing: the group limit and the correction bias
    each move some tokens' experts, and the renormalised, scaled weights sum to the scaling factor."""
    logits = torch.randn(300, 16, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(16, generator=torch.Generator().manual_seed(3)) * 0.1
    plain = select_experts(logits, 4, scoring="sigmoid")[1].sort(-1).values
    grouped = select_experts(logits, 4, scoring="sigmoid", n_group=4, topk_group=2)[1].sort(-1).values
    biased = select_experts(logits, 4, scoring="sigmoid", correction_bias=bias)[1].sort(-1).values
    assert (plain != grouped).any(-1).sum() > 30 and (plain != biased).any(-1).sum() > 30
    # every token's experts come from its two best groups (a group scored by its best expert, without a bias)
    best_groups = logits.sigmoid().view(300, 4, 4).amax(-1).topk(2, -1).indices.tolist()
    assert all(set(r) <= set(b) for r, b in zip((grouped // 4).tolist(), best_groups))
    weights, _ = select_experts(logits, 4, scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5)
    torch.testing.assert_close(weights.sum(-1), torch.full((300,), 2.5))


def _experts(num_experts=8, hidden=H, inter=48, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = FusedExperts(num_experts, hidden, inter, dtype)
    # the checkpoint's per-expert tensors: gate and up [inter, hidden], down [hidden, inter]
    tensors = {
        (e, p): torch.randn((inter, hidden) if p != "down" else (hidden, inter), generator=g) * 0.2
        for e in range(num_experts)
        for p in ("gate", "up", "down")
    }
    for (e, p), t in tensors.items():
        stack = ex.down_proj if p == "down" else ex.gate_up_proj
        stack.weight.weight_loader(stack.weight, t.to(dtype), (e, 1 if p == "up" else 0))
    return ex, tensors


def _reference(tensors, x, weights, ids):
    """Float64, one (token, choice) at a time."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            xt = x[t].double()
            gate, up, down = (tensors[(e, p)].double() for p in ("gate", "up", "down"))
            out[t] += w * (down @ (torch.nn.functional.silu(gate @ xt) * (up @ xt)))
    return out


@pytest.mark.parametrize("tokens, k", [(1, 2), (7, 3), (300, 2)])
def test_grouped_experts_equal_a_float64_per_token_loop(tokens, k):
    ex, tensors = _experts()
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    # experts 0-5 only, so that some experts have no token, and the sort meets repeated ids
    ids = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    out = ex(x, weights, ids)
    torch.testing.assert_close(out.double(), _reference(tensors, x, weights, ids), atol=1e-5, rtol=1e-5)
    empty = ex(x[:0], weights[:0], ids[:0])  # a step with no token for this layer's experts
    assert empty.shape == (0, H)
    bf16, _ = _experts(dtype=torch.bfloat16)
    out16 = bf16(x.bfloat16(), weights, ids)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), _reference(tensors, x, weights, ids), atol=0.1, rtol=0.05)


def test_the_experts_weight_loader_names_shapes_and_refuses_a_stacked_tensor():
    ex = FusedExperts(4, H, 48, torch.float32)
    w = ex.gate_up_proj.weight
    with pytest.raises(WeightShapeError) as e:
        w.weight_loader(w, torch.zeros(47, H), (2, 1))
    assert (e.value.expected, e.value.got) == ((48, H), (47, H))  # the whole tensor's, not a rank's slice
    with pytest.raises(WeightLoadError, match="one tensor per expert"):
        w.weight_loader(w, torch.zeros(4, 96, H))


def test_a_tensor_parallel_rank_holds_its_slice_of_every_expert_and_the_partial_sums_add_up(monkeypatch):
    full, tensors = _experts(num_experts=4, inter=48)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5))
    ids = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(i))[:2] for i in range(9)])
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(6))
    monkeypatch.setattr(moe, "tp_size", lambda: 2)
    parts = []
    for rank in (0, 1):
        monkeypatch.setattr(moe, "tp_rank", lambda rank=rank: rank)
        ex, _ = _experts(num_experts=4, inter=48)
        assert ex.gate_up_proj.weight.shape == (4, 48, H) and ex.down_proj.weight.shape == (4, H, 24)
        half = slice(24 * rank, 24 * (rank + 1))
        # each of gate and up cut separately (not the stacked rows in two), and down by its input columns
        assert torch.equal(ex.gate_up_proj.weight[3], torch.cat([tensors[(3, "gate")][half], tensors[(3, "up")][half]]))
        assert torch.equal(ex.down_proj.weight[3], tensors[(3, "down")][:, half])
        parts.append(ex(x, weights, ids))
    torch.testing.assert_close(parts[0] + parts[1], full(x, weights, ids), atol=1e-5, rtol=1e-5)


def _load_llama_mlp(mlp: LlamaMLP, theirs) -> None:
    gu = mlp.gate_up_proj
    gu.weight.weight_loader(gu.weight, theirs.gate_proj.weight.detach(), 0)
    gu.weight.weight_loader(gu.weight, theirs.up_proj.weight.detach(), 1)
    mlp.down_proj.weight.data.copy_(theirs.down_proj.weight)


def _load_experts(experts: FusedExperts, theirs) -> None:
    """From transformers' stacked gate_up_proj [E, 2I, H] / down_proj [E, H, I], through our per-expert loader."""
    gate_up, down = theirs.gate_up_proj.detach(), theirs.down_proj.detach()
    inter = down.shape[-1]
    for e in range(gate_up.shape[0]):
        w = experts.gate_up_proj.weight
        w.weight_loader(w, gate_up[e, :inter], (e, 0))
        w.weight_loader(w, gate_up[e, inter:], (e, 1))
        experts.down_proj.weight.weight_loader(experts.down_proj.weight, down[e], (e, 0))


def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [*module.parameters(), *module.buffers()]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_qwen2_moe_block_with_its_gated_shared_expert_equals_transformers():
    cfg = Qwen2MoeConfig(
        hidden_size=H, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=96, norm_topk_prob=False,
    )  # fmt: skip
    theirs = Qwen2MoeSparseMoeBlock(cfg).eval()
    _randomise(theirs, 7)
    shared = LlamaMLP(with_intermediate_size(cfg, 96), False, torch.float32, lambda prefix: None, "mlp.shared_expert")
    ours = SparseMoeBlock(
        TopKRouter(H, 8, 2, dtype=torch.float32), FusedExperts(8, H, 32, torch.float32), shared_expert=shared,
        shared_expert_name="shared_expert", shared_expert_gate=True, dtype=torch.float32,
    )  # fmt: skip
    ours.gate.weight.data.copy_(theirs.gate.weight)
    _load_experts(ours.experts, theirs.experts)
    _load_llama_mlp(ours.shared_expert, theirs.shared_expert)
    ours.shared_expert_gate.weight.data.copy_(theirs.shared_expert_gate.weight)
    assert {n.split(".")[0] for n, _ in ours.named_parameters()} == {
        "gate", "experts", "shared_expert", "shared_expert_gate"
    }  # fmt: skip
    x = torch.randn(1, 50, H, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), theirs(x)[0], atol=1e-5, rtol=1e-5)


def test_deepseek_v3_block_with_shared_experts_equals_transformers():
    """Not a family fulcrum runs yet: the switches DeepSeek's model will use, on transformers' own block."""
    cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=32, n_shared_experts=2, norm_topk_prob=True, **GROUPS)
    theirs = DeepseekV3MoE(cfg).eval()
    _randomise(theirs, 9)
    with torch.no_grad():
        theirs.gate.e_score_correction_bias.mul_(0.5)
    shared = LlamaMLP(with_intermediate_size(cfg, 64), False, torch.float32, lambda prefix: None, "mlp.shared_experts")
    ours = SparseMoeBlock(
        TopKRouter(H, 16, 4, **ROUTERS["deepseek-v3"][2], dtype=torch.float32), FusedExperts(16, H, 32, torch.float32),
        shared_expert=shared, shared_expert_name="shared_experts",
    )  # fmt: skip
    ours.gate.weight.data.copy_(theirs.gate.weight)
    ours.gate.e_score_correction_bias.data.copy_(theirs.gate.e_score_correction_bias)
    _load_experts(ours.experts, theirs.experts)
    _load_llama_mlp(ours.shared_experts, theirs.shared_experts)
    x = torch.randn(1, 50, H, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), theirs(x)[0], atol=1e-5, rtol=1e-5)
