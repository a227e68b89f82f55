"""Block-wise fp8 checkpoints (quant_method "fp8", weight_block_size, *.weight_scale_inv), as DeepSeek-V3/R1 and the
Qwen3-*-FP8 releases ship them. A tiny random Qwen3, Qwen3-MoE or DeepSeek-V3 (MLA and experts) built by transformers
has every linear weight quantized here to float8_e4m3fn with one fp32 scale per tile (the tile's largest magnitude
over 448), saved with the quantization_config those releases write; the LM head, the embedding, the norms and the
routers stay in full precision, as there. fulcrum's logits on that folder equal transformers' on the same weights
dequantized (an ordinary fp32 checkpoint) to fp32 rounding, and its greedy tokens through the engine equal
transformers'. A malformed checkpoint fails at load, naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fulcrum import SamplingParams
from fulcrum.config import ModelConfig
from fulcrum.errors import ModelLoadError, WeightLoadError
from fulcrum.layers.moe import FusedExperts
from fulcrum.models.loader import load_model
from fulcrum.plan import roofline
from fulcrum.plan.model_spec import active_weight_bytes, kv_bytes_per_token, load_model_spec, weight_bytes
from fulcrum.quant import describe, formats
from fulcrum.quant.fp8_block import BlockFp8Method
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_llm_parity import make_llm
from tests.models.test_moe import _mean_error as mean_error
from tests.models.test_parity import hf_logits, max_diff, our_logits, prompts
from tests.tiny_models import hf_model, save_tiny_model

LENS = [1, 5, 17, 40]


def release_config(block) -> dict:
    """The quantization_config DeepSeek-V3 and the Qwen3 FP8 releases write."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def is_linear(name: str) -> bool:
    """A linear layer's weight (the projections, an expert's included), not the head, embedding, norms or router."""
    parts = name.split(".")
    return parts[-1] == "weight" and (parts[-2].endswith("_proj") or parts[-2] == "kv_a_proj_with_mqa")


def write_fp8_checkpoint(src, dst, ref, block, config=None, skip=()):
    """`dst`: `src` with every linear weight in block-wise fp8 (weight + weight_scale_inv) and `config` (the
    releases' by default) as its quantization_config; `ref`: the same weights dequantized, an ordinary checkpoint."""
    tensors = load_file(src / "model.safetensors")
    quant, deq = {}, dict(tensors)
    for name, t in tensors.items():
        if is_linear(name) and not any(s in name for s in skip):
            q, scale_inv = formats.quantize_fp8_blocks(t, block)
            quant[name], quant[f"{name}_scale_inv"] = q, scale_inv
            deq[name] = formats.dequantize_fp8_blocks(q, scale_inv, block)
        else:
            quant[name] = t
    for folder, weights, qc in ((dst, quant, config or release_config(block)), (ref, deq, None)):
        shutil.copytree(src, folder)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        if qc is not None:
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return dst, ref


def _load(folder, **kw):
    return load_model(ModelConfig.from_path(folder, dtype="float32", **kw))


CASES = {
    # Qwen3's shapes with 32x32 tiles: every layer has several blocks of inputs (the scales applied per block)
    "qwen3-32": ("qwen3", (32, 32), {}),
    # 48x48 tiles over 64 hidden, 128 q outputs: tiles cut short at the edges, and q/k/v and gate/up shards whose
    # boundaries fall inside a tile row
    "qwen3-48": ("qwen3", (48, 48), {}),
    # the releases' 128x128 on a model wide enough for two blocks of inputs (hidden 256, intermediate 384)
    "qwen3-128": ("qwen3", (128, 128), dict(hidden_size=256, intermediate_size=384)),
    # the releases' 128x128 where every layer has a single block of inputs: a scale per output channel
    "qwen3-128-channel": ("qwen3", (128, 128), {}),
    "qwen3-moe-16": ("qwen3-moe", (16, 16), {}),
    "deepseek-v3-moe-16": ("deepseek-v3-moe", (16, 16), {}),  # kv_a's 40 rows and q_a's 24 cut tiles short
    "deepseek-v3-moe-8": ("deepseek-v3-moe", (8, 8), {}),  # every size a multiple of the tile
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    made = {}

    def make(case):
        if case not in made:
            family, block, sizes = CASES[case]
            src = save_tiny_model(family, root / f"{case}-src", **sizes)
            made[case] = write_fp8_checkpoint(src, root / case, root / f"{case}-ref", block)
        return made[case]

    return make


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers_on_the_dequantized_weights(checkpoints, case):
    quant_dir, ref_dir = checkpoints(case)
    ours = _load(quant_dir)
    batch = prompts(2048, lens=LENS)
    want = hf_logits(hf_model(ref_dir), batch)
    assert max_diff(our_logits(ours, batch), want) <= 1e-4 * max(w.abs().max().item() for w in want)
    # the weights stay fp8 in memory: one byte a weight, with their scales
    layer = ours.model.layers[-1]
    attn = layer.self_attn
    first = attn.qkv_proj if hasattr(attn, "qkv_proj") else attn.q_a_proj
    assert first.qweight.dtype == torch.float8_e4m3fn and not hasattr(first, "weight")
    block = CASES[case][1]
    rows, blocks = sum(first.output_sizes), -(-first.input_size // block[1])
    if blocks == 1:  # one block of inputs: a scale per output channel, the online fp8 layout
        assert (first.qweight.shape, first.scales.shape) == ((rows, first.input_size), (rows,))
    else:  # block-major, a scale per output channel of each block of inputs
        assert (first.qweight.shape, first.scales.shape) == ((blocks, rows, block[1]), (blocks, rows))
    experts = getattr(layer.mlp, "experts", None)
    if experts is not None:
        down = experts.down_proj  # block-major too: [E, blocks, rows, b1], a scale per row of each block
        blocks = -(-down.input_size // block[1])
        assert down.qweight.dtype == torch.float8_e4m3fn and not hasattr(down, "weight")
        assert (down.qweight.shape[:3], down.scales.shape) == ((8, blocks, 64), (8, blocks, 64))
    assert ours.lm_head.weight.dtype == torch.float32  # the head stays in full precision, as the releases store it


@pytest.mark.parametrize("case", ["qwen3-32", "qwen3-moe-16", "deepseek-v3-moe-8"])
def test_transformers_reads_the_fp8_checkpoint_itself_as_fulcrum_does(checkpoints, case):
    """transformers' own fp8 integration (on CPU it dequantizes at load) on the same folder: the tiles, their
    scales' direction (scale_inv multiplies) are read alike. (Its CPU path refuses tiles cut short at an edge,
    which DeepSeek-V3's kv_a_proj_with_mqa has, 576 rows: the cases here have none.)"""
    quant_dir, _ = checkpoints(case)
    batch = prompts(2048, lens=LENS)
    want = hf_logits(hf_model(quant_dir), batch)
    assert max_diff(our_logits(_load(quant_dir), batch), want) <= 1e-4 * max(w.abs().max().item() for w in want)


@pytest.mark.parametrize("case", ["qwen3-48", "qwen3-128", "qwen3-moe-16"])
def test_bfloat16_logits_as_close_to_float32_as_transformers_bfloat16(checkpoints, case):
    """In bf16 the fp8 weights widen exactly and each product sums in fp32 (few rows) or the weight rounds once to
    bf16 (many): not transformers' order, so a router's near-tie may flip one token's experts on one side (as
    tests/models/test_moe.py measures for the bf16 families; the tiny DeepSeek-V3's sigmoid router with its random
    correction bias flips one token here, so its layers are checked one by one below). The measure is transformers'
    float32 run on the dequantized weights: our bf16 logits are on average as close to it as transformers' bf16
    logits are."""
    quant_dir, ref_dir = checkpoints(case)
    batch = prompts(2048, lens=LENS)
    ref32 = hf_logits(hf_model(ref_dir), batch)
    theirs = hf_logits(hf_model(ref_dir, torch.bfloat16), batch)
    ours = our_logits(load_model(ModelConfig.from_path(quant_dir, dtype="bfloat16")), batch)
    assert mean_error(ours, ref32) <= 1.1 * mean_error(theirs, ref32)


def test_bfloat16_layers_compute_the_dequantized_product(checkpoints):
    """Every fp8 linear layer of the bf16 DeepSeek-V3 (MLA projections, dense and shared MLPs) and its experts, on
    one row (the fp8 GEMV per block of inputs) and on 100 (the widened weight): within bf16 rounding of the fp32
    product with the dequantized weights."""
    quant_dir, _ = checkpoints("deepseek-v3-moe-16")
    model = load_model(ModelConfig.from_path(quant_dir, dtype="bfloat16"))
    layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), BlockFp8Method)]
    assert len(layers) == 3 * 4 + 2 * 2 + 2  # q_a, q_b, kv_a, o per layer (kv_b is W_UK/W_UV now); 2 MLPs of 2
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        for rows in (1, 100):
            x = torch.randn(rows, layer.input_size, generator=g).bfloat16()
            want = x.float() @ layer.quant_method.dequantize(layer).T
            assert (layer(x).float() - want).abs().max() <= 0.01 * want.abs().max()
    experts = model.model.layers[1].mlp.experts
    x = torch.randn(40, 64, generator=g).bfloat16()
    ids = torch.randint(0, 8, (40, 2), generator=g)
    weights = torch.rand(40, 2, generator=g)
    want = torch.zeros(40, 64)
    for t in range(40):
        for k in range(2):
            e = int(ids[t, k])
            w13 = experts.gate_up_proj.expert(e)
            gate, up = (x[t].float() @ w13.T).chunk(2)
            want[t] += weights[t, k] * (experts.down_proj.expert(e) @ (F.silu(gate) * up))
    assert (experts(x, weights, ids).float() - want).abs().max() <= 0.01 * want.abs().max()


@pytest.mark.parametrize("case", ["qwen3-48", "qwen3-128-channel", "qwen3-moe-16", "deepseek-v3-moe-16"])
def test_greedy_tokens_through_the_engine_equal_transformers(checkpoints, case):
    quant_dir, ref_dir = checkpoints(case)
    llm = make_llm(quant_dir)
    batch = prompts(2048, seed=5, lens=[3, 17, 40])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(ref_dir, p, 8)[0] for p in batch]


def test_the_format_is_named_and_a_checkpoint_quantization_must_be_its_own(checkpoints):
    quant_dir, _ = checkpoints("deepseek-v3-moe-16")
    config = ModelConfig.from_path(quant_dir, dtype="float32")
    assert config.quantization == "fp8-block"
    line = describe(config.quantization, checkpoint=config.hf_config.quantization_config)
    assert line.startswith("fp8 e4m3, block-wise (16x16 scales)")
    assert ModelConfig.from_path(quant_dir, quantization="fp8").quantization == "fp8-block"  # the checkpoint's own
    with pytest.raises(ModelLoadError, match="already quantized"):
        ModelConfig.from_path(quant_dir, quantization="int8")


def held_bytes(model) -> int:
    """What the loaded model holds for its weights: parameters and buffers (MLA's W_UK and W_UV among them, which
    replace kv_b_proj), not the rotary tables."""
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if not n.endswith((".cos", ".sin")))]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("case", ["qwen3-48", "qwen3-128", "qwen3-moe-16", "deepseek-v3-moe-16"])
def test_plan_counts_the_weight_and_cache_bytes_the_engine_holds(checkpoints, case):
    quant_dir, _ = checkpoints(case)
    spec = load_model_spec(quant_dir)
    assert (spec.weight_format, spec.weight_block) == ("fp8", CASES[case][1])
    llm = make_llm(quant_dir)
    runner = llm.core.runner
    assert weight_bytes(spec, "fp8") == held_bytes(runner.model)
    assert runner.bytes_per_block == runner.block_size * kv_bytes_per_token(spec, "fp32")
    # a decode step reads every weight but the embedding table (and the experts no token routes to)
    embedding = runner.model.model.embed_tokens.weight
    read = roofline.weight_bytes_read(spec, "fp8", batch=10**6)  # so many tokens that every expert is read
    assert read == pytest.approx(held_bytes(runner.model) - embedding.numel() * embedding.element_size())
    # one token reads the routed experts it is sent to, each as the engine holds an expert (fp8 and its scales)
    layers = [m for m in runner.model.modules() if isinstance(m, FusedExperts)]
    held_experts = sum(t.numel() * t.element_size() for m in layers for t in [*m.parameters(), *m.buffers()])
    unused = 0 if spec.moe is None else held_experts * (1 - spec.moe.experts_per_token / spec.moe.num_experts)
    assert active_weight_bytes(spec, "fp8") == pytest.approx(held_bytes(runner.model) - unused)


def test_modules_to_not_convert_stay_in_full_precision(checkpoints, tmp_path):
    src = save_tiny_model("qwen3", tmp_path / "src")
    config = {**release_config((32, 32)), "modules_to_not_convert": ["o_proj", "model.layers.1.mlp.down_proj"]}
    quant_dir, ref_dir = write_fp8_checkpoint(
        src, tmp_path / "q", tmp_path / "ref", (32, 32), config, skip=("o_proj", "layers.1.mlp.down_proj")
    )
    ours = _load(quant_dir)
    batch = prompts(2048, lens=LENS)
    assert max_diff(our_logits(ours, batch), hf_logits(hf_model(ref_dir), batch)) <= 1e-3
    layers = ours.model.layers
    assert layers[0].self_attn.o_proj.weight.dtype == torch.float32
    assert layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert layers[0].mlp.down_proj.qweight.dtype == torch.float8_e4m3fn


def rewrite(folder, dst, change_tensors=None, **config_changes):
    shutil.copytree(folder, dst)
    if change_tensors:
        tensors = load_file(dst / "model.safetensors")
        change_tensors(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        qc = {k: v for k, v in {**cfg["quantization_config"], **config_changes}.items() if v is not None}
        (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return dst


NAME = "model.layers.0.self_attn.k_proj.weight"
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.mark.parametrize(
    ("case", "change", "message"),
    [
        ("qwen3-32", lambda t: t.pop(f"{NAME}_scale_inv"), "lacks 1 tensor.*k_proj.weight_scale_inv"),
        ("qwen3-moe-16", lambda t: t.pop(f"{EXPERT}_scale_inv"), "lacks 1 tensor.*experts.3.up_proj.weight_scale_inv"),
        (
            "qwen3-32",
            lambda t: t.update({f"{NAME}_scale_inv": t[f"{NAME}_scale_inv"][:, :1].contiguous()}),
            r"k_proj.weight_scale_inv: checkpoint shape \(2, 1\), model expects \(2, 2\)",
        ),
        (
            "qwen3-moe-16",
            lambda t: t.update({f"{EXPERT}_scale_inv": torch.ones(3, 3)}),
            r"experts.3.up_proj.weight_scale_inv: checkpoint shape \(3, 3\), model expects \(3, 4\)",
        ),
        ("qwen3-32", lambda t: t.update({NAME: t[NAME].float()}), "k_proj.weight: dtype torch.float32.*float8_e4m3fn"),
    ],
)
def test_malformed_tensors_fail_naming_them(checkpoints, tmp_path, case, change, message):
    quant_dir, _ = checkpoints(case)
    with pytest.raises(WeightLoadError, match=message):
        _load(rewrite(quant_dir, tmp_path / "bad", change))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(activation_scheme="static"), "fp8 activation_scheme 'static' is not supported.*dynamic"),
        (dict(weight_block_size=None), "without weight_block_size"),
        (dict(weight_block_size=[128]), r"weight_block_size must be two positive whole numbers.*\[128\]"),
        (dict(weight_block_size=[0, 128]), "weight_block_size must be two positive"),
        (dict(fmt="e5m2"), "fp8 fmt 'e5m2' is not supported"),
    ],
)
def test_unsupported_settings_fail_at_load_naming_them(checkpoints, tmp_path, changes, message):
    quant_dir, _ = checkpoints("qwen3-32")
    with pytest.raises(ModelLoadError, match=message):
        _load(rewrite(quant_dir, tmp_path / "bad", **changes))


@pytest.mark.parametrize(
    ("family", "block", "sizes", "down_scales"),
    [
        # the experts' 48 inputs are 24 a rank: 3 blocks of 8
        ("qwen3-moe", (8, 8), {}, (8, 3, 64)),
        # one KV head for two ranks: k and v replicated, each rank reading the same rows and scales
        ("qwen3", (32, 32), dict(num_key_value_heads=1), None),
        # MLA: q_b and kv_b split by heads, q_a and kv_a replicated; experts' 32 inputs 16 a rank
        ("deepseek-v3-moe", (8, 8), {}, (8, 2, 64)),
    ],
)
def test_tensor_parallel_splits_the_block_scales_with_the_weights(tmp_path, family, block, sizes, down_scales):
    """Two ranks: q/k/v, gate/up and the experts' gate/up split by rows (the widened scales with them), o_proj and
    the down projections by inputs in whole blocks."""
    src = save_tiny_model(family, tmp_path / "src", **sizes)
    quant_dir, ref_dir = write_fp8_checkpoint(src, tmp_path / "q", tmp_path / "ref", block)
    llm = make_llm(quant_dir, tensor_parallel_size=2, cpu_threads=1)
    try:
        batch = prompts(2048, seed=5, lens=[3, 17])
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        experts = getattr(llm.core.runner.model.model.layers[-1].mlp, "experts", None)
        if down_scales:  # rank 0's share of the experts' inputs, in whole blocks
            assert tuple(experts.down_proj.scales.shape) == down_scales
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(ref_dir, p, 8)[0] for p in batch]


def test_a_tensor_parallel_split_inside_a_block_of_inputs_is_refused(checkpoints):
    quant_dir, _ = checkpoints("qwen3-moe-16")  # the experts' 48 inputs: 24 a rank, not whole blocks of 16
    with pytest.raises(ModelLoadError, match="24 per rank, not a multiple of the checkpoint's fp8 block of 16"):
        make_llm(quant_dir, tensor_parallel_size=2, cpu_threads=1)
