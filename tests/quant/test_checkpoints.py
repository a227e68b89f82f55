"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) load as the tools write them. Each test quantizes a tiny
random model's linear weights into a format's tensors, packed here from the format's published description (or, for
compressed-tensors, by the library's own compressors too), and saves them with the quantization_config a tool writes.
fulcrum's logits on that folder stay within 1e-3 of the largest logit of the same model whose weights are the
dequantized values in fp32 (written as an ordinary checkpoint), and its greedy tokens through the engine equal
transformers' on that dequantized checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fulcrum import LLM, SamplingParams
from fulcrum.config import ModelConfig
from fulcrum.errors import ModelLoadError, WeightLoadError
from fulcrum.layers.attention import AttentionMetadata
from fulcrum.models.loader import load_model
from fulcrum.quant import describe
from tests.engine.hf_reference import hf_greedy
from tests.tiny_models import save_tiny_model

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SIZES = dict(hidden_size=128, intermediate_size=256)  # every group size, 32 to 128, divides every input
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds output 8c + AWQ_ORDER[k]


# -- packing, from the formats' descriptions -----------------------------------------------------------------


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words -> the int32 whose 32 bits they are (two's complement)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Unsigned values -> int32 words along `dim`: value k of a word (bits k*bits..) is element
    c * (32 / bits) + order[k] of that dimension."""
    per = 32 // bits
    order = order or range(per)
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    words = sum(v[..., j] << (bits * k) for k, j in enumerate(order))
    return to_int32(words).movedim(-1, dim).contiguous()


def int4_groups(w: torch.Tensor, g_idx: torch.Tensor, sym: bool):
    """GPTQ/AWQ's 4 bits: q in 0..15 with W ~ (q - z) * s for the inputs of each group (g_idx[i]: input i's group);
    scales rounded to fp16, as the checkpoints store them. Returns q [O, I], s and z [O, groups], W's dequantized."""
    groups = int(g_idx.max()) + 1
    cols = w[:, torch.argsort(g_idx, stable=True)].reshape(w.shape[0], groups, -1)  # each group's inputs
    lo, hi = cols.amin(-1).clamp(max=0), cols.amax(-1).clamp(min=0)
    if sym:
        s, z = torch.maximum(-lo, hi) * 2 / 15, torch.full_like(lo, 8)
    else:
        s = (hi - lo) / 15
        z = torch.round(-lo / s)
    s = s.half().float()
    q = (torch.round(w / s[:, g_idx]) + z[:, g_idx]).clamp(0, 15)
    return q, s, z, (q - z[:, g_idx]) * s[:, g_idx]


def gptq(w, group=128, sym=True, desc_act=False, v2=False, seed=0, zero_bias=False):
    out_f, in_f = w.shape
    size = in_f if group == -1 else group
    g_idx = torch.arange(in_f) // size
    if desc_act:  # activation order: the groups take the inputs in a random order
        g_idx = torch.empty_like(g_idx)
        g_idx[torch.randperm(in_f, generator=torch.Generator().manual_seed(seed))] = torch.arange(in_f) // size
    q, s, z, deq = int4_groups(w, g_idx, sym)
    qzeros = pack(z.T, 4, dim=1)
    if not v2:  # "gptq" stores each zero point minus one
        qzeros = to_int32(qzeros.to(torch.int64) - 0x11111111)
    tensors = {"qweight": pack(q.T, 4, dim=0), "qzeros": qzeros, "scales": s.T.half(), "g_idx": g_idx.int()}
    if zero_bias:  # AutoGPTQ writes one for every layer, a model without biases included
        tensors["bias"] = torch.zeros(out_f, dtype=torch.float16)
    return tensors, deq


def awq(w, group=128):
    g_idx = torch.arange(w.shape[1]) // group
    q, s, z, deq = int4_groups(w, g_idx, sym=False)
    tensors = {
        "qweight": pack(q.T, 4, dim=1, order=AWQ_ORDER),
        "qzeros": pack(z.T, 4, dim=1, order=AWQ_ORDER),
        "scales": s.T.half(),
    }
    return tensors, deq


def ct_int4(w, strategy="group", group=128, sym=False):
    """compressed-tensors' int4: signed values in -8..7, W ~ (q - zp) * s, stored plus 8."""
    out_f, in_f = w.shape
    size = group if strategy == "group" else in_f
    g = w.reshape(out_f, in_f // size, size)
    if strategy == "tensor":
        g = w.reshape(1, 1, -1)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if sym:
        s, zp = torch.maximum(-lo, hi) / 7.5, torch.zeros_like(lo)
    else:
        s = (hi - lo) / 15
        zp = torch.round(-8 - lo / s).clamp(-8, 7)
    full_s = s.repeat_interleave(size, 1).expand(out_f, in_f) if strategy != "tensor" else s.expand(out_f, in_f)
    full_zp = zp.repeat_interleave(size, 1).expand(out_f, in_f) if strategy != "tensor" else zp.expand(out_f, in_f)
    q = (torch.round(w / full_s) + full_zp).clamp(-8, 7)
    tensors = {
        "weight_packed": pack(q + 8, 4, dim=1),
        "weight_scale": s.reshape(1) if strategy == "tensor" else s,
        "weight_shape": torch.tensor([out_f, in_f]),
    }
    if not sym:
        tensors["weight_zero_point"] = zp.reshape(1).to(torch.int8) if strategy == "tensor" else pack(zp + 8, 4, dim=0)
    return tensors, (q - full_zp) * full_s


def ct_int8(w):
    s = w.abs().amax(1, keepdim=True) / 127.5
    q = torch.round(w / s).clamp(-128, 127)
    return {"weight": q.to(torch.int8), "weight_scale": s}, q * s


def ct_fp8(w, strategy="channel"):
    s = w.abs().amax(1, keepdim=True) / 448 if strategy == "channel" else w.abs().amax().reshape(1) / 448
    q = (w / s).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": s}, q.float() * s


def ct_config(fmt, weights, ignore=("lm_head",)):
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None, "format": fmt}
        },
        "ignore": list(ignore),
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
    }


# name -> (writer of one module's tensors, quantization_config, family)
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
CT_INT4 = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}
CT_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
CT_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
FORMATS = {
    "gptq-g128-sym": (lambda w: gptq(w, zero_bias=True), GPTQ, "llama"),
    "gptq-g64-asym-v2": (
        lambda w: gptq(w, 64, sym=False, v2=True),
        {**GPTQ, "group_size": 64, "sym": False, "checkpoint_format": "gptq_v2"},
        "llama",
    ),
    "gptq-g32-asym-desc_act": (
        lambda w: gptq(w, 32, sym=False, desc_act=True),
        {**GPTQ, "group_size": 32, "sym": False, "desc_act": True},
        "llama",
    ),
    "gptq-g128-desc_act-qwen2": (lambda w: gptq(w, desc_act=True), {**GPTQ, "desc_act": True}, "qwen2"),
    "gptq-channel-desc_act-lm_head": (
        lambda w: gptq(w, -1, desc_act=True),
        {**GPTQ, "group_size": -1, "desc_act": True, "lm_head": True},
        "llama",
    ),
    "awq-g128": (lambda w: awq(w), AWQ, "llama"),
    "awq-g32-qwen2": (lambda w: awq(w, 32), {**AWQ, "group_size": 32}, "qwen2"),
    "ct-int4-g128-asym": (lambda w: ct_int4(w), ct_config("pack-quantized", CT_INT4), "llama"),
    "ct-int4-g64-sym-qwen2": (
        lambda w: ct_int4(w, group=64, sym=True),
        ct_config("pack-quantized", {**CT_INT4, "group_size": 64, "symmetric": True}),
        "qwen2",
    ),
    "ct-int4-channel-asym": (
        lambda w: ct_int4(w, "channel"),
        ct_config("pack-quantized", {**CT_INT4, "strategy": "channel", "group_size": None}),
        "llama",
    ),
    "ct-int8-channel": (ct_int8, ct_config("int-quantized", CT_INT8), "llama"),
    "ct-fp8-channel": (ct_fp8, ct_config("float-quantized", CT_FP8), "llama"),
    "ct-fp8-tensor-qwen2": (
        lambda w: ct_fp8(w, "tensor"),
        ct_config("float-quantized", {**CT_FP8, "strategy": "tensor"}),
        "qwen2",
    ),
}


def quantized_head(config: dict) -> bool:
    return bool(config.get("lm_head"))


def write_checkpoint(src, quant_dir, ref_dir, writer, config: dict, skip=()):
    """`quant_dir`: the model with every linear weight in `writer`'s tensors (the LM head too where `config`
    quantizes it) and `config` as its quantization_config; `ref_dir`: the same weights dequantized, unquantized."""
    tensors = load_file(src / "model.safetensors")
    quant, ref = {}, dict(tensors)
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and any(f".{p}." in name for p in LINEAR)
        if (linear or (name == "lm_head.weight" and quantized_head(config))) and not any(s in name for s in skip):
            packed, deq = writer(t)
            quant.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
            ref[name] = deq.float().contiguous()
        else:
            quant[name] = t
    for folder, weights, qc in ((quant_dir, quant, config), (ref_dir, ref, None)):
        shutil.copytree(src, folder)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        if qc is not None:
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return quant_dir, ref_dir


def logits(folder, **kw):
    model = load_model(ModelConfig.from_path(folder, "float32", **kw))
    ids = torch.randint(5, 2048, (40,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(40), AttentionMetadata.for_prompts([40]))), model


def assert_matches_reference(quant_dir, ref_dir):
    got, model = logits(quant_dir)
    want, _ = logits(ref_dir)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    llm = LLM(model=str(quant_dir), dtype="float32", kv_cache_memory=16 << 20)
    prompts = [torch.randint(5, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(ref_dir, p, 10)[0] for p in prompts]
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {f: save_tiny_model(f, root / f, **SIZES) for f in ("llama", "qwen2")}


@pytest.mark.parametrize("name", FORMATS)
def test_checkpoint_matches_its_dequantized_weights(models, tmp_path, name):
    writer, config, family = FORMATS[name]
    quant_dir, ref_dir = write_checkpoint(models[family], tmp_path / "q", tmp_path / "ref", writer, config)
    model = assert_matches_reference(quant_dir, ref_dir)
    # the layers hold fulcrum's own packed layout, and none of the checkpoint's tensors
    qkv = model.model.layers[0].self_attn.qkv_proj
    packed = torch.float8_e4m3fn if "fp8" in name else torch.int8 if "int8" in name else torch.uint8
    assert qkv.qweight.dtype == packed
    assert not any(hasattr(qkv, t) for t in ("weight", "qzeros", "g_idx", "weight_packed", "weight_scale"))
    # act order permutes the inputs where there are groups to gather them in (down_proj's 256 inputs: 2 groups or more)
    down = model.model.layers[0].mlp.down_proj
    assert hasattr(down, "input_perm") == (config.get("desc_act", False) and config.get("group_size") != -1)
    assert hasattr(model.lm_head, "qweight") == quantized_head(config)


# -- compressed-tensors' own compressors write the checkpoint ------------------------------------------------

LIBRARY = {
    "int4-g64-asym": ("pack-quantized", {**CT_INT4, "group_size": 64}),
    "int4-g128-sym": ("pack-quantized", {**CT_INT4, "symmetric": True}),
    "int8-channel-packed": ("pack-quantized", CT_INT8),
    "int8-channel": ("int-quantized", CT_INT8),
    "fp8-tensor": ("float-quantized", {**CT_FP8, "strategy": "tensor"}),
}


def library_checkpoint(src, quant_dir, ref_dir, fmt: str, weights: dict):
    """What llm-compressor does on saving: the scheme applied to the model's Linear modules but the LM head, the
    scales and zero points of each weight's range (min-max), compressed, saved, config.json updated; the reference
    is the library's own decompression of each saved module."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    from tests.tiny_models import hf_model

    model = hf_model(src)
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            if args.strategy == "group":
                g = w.reshape(w.shape[0], -1, args.group_size)
                lo, hi = g.amin(-1), g.amax(-1)
            elif args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            else:
                lo, hi = w.min().reshape(1), w.max().reshape(1)
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(quant_dir)
    compressor.update_config(quant_dir)
    shutil.copy(src / "tokenizer.json", quant_dir)
    shutil.copy(src / "tokenizer_config.json", quant_dir)

    saved = load_file(quant_dir / "model.safetensors")
    ref = {k: v for k, v in saved.items() if not k.rpartition(".")[0].endswith(LINEAR)}
    for module in {k.rpartition(".")[0] for k in saved if k.endswith(".weight_scale")}:
        local = {k.rpartition(".")[2]: v for k, v in saved.items() if k.rpartition(".")[0] == module}
        ref[f"{module}.weight"] = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"]
        ref.update({k: v for k, v in saved.items() if k == f"{module}.bias"})
    shutil.copytree(src, ref_dir)
    save_file({k: v.float().contiguous() for k, v in ref.items()}, ref_dir / "model.safetensors")
    assert json.loads((quant_dir / "config.json").read_text())["quantization_config"]["version"] == ct.__version__
    return quant_dir, ref_dir


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("name", LIBRARY)
def test_compressed_tensors_written_by_the_library(models, tmp_path, name, family):
    if family == "qwen2" and not name.startswith("int4"):
        pytest.skip("one family is enough for the one-byte formats")
    quant_dir, ref_dir = library_checkpoint(models[family], tmp_path / "q", tmp_path / "ref", *LIBRARY[name])
    model = assert_matches_reference(quant_dir, ref_dir)
    assert not hasattr(model.model.layers[1].mlp.down_proj, "weight")


# -- modules left in full precision --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, config, skip",
    [
        ("awq", {**AWQ, "modules_to_not_convert": ["down_proj"]}, ("down_proj",)),
        ("gptq", {**GPTQ, "dynamic": {r"-:model\.layers\.1\..*": {}}}, ("layers.1.",)),
        (
            "gptq",
            {**GPTQ, "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]]},
            ("o_proj", "gate", "up", "down"),
        ),
        ("ct", ct_config("pack-quantized", CT_INT4, ignore=["lm_head", r"re:.*mlp\.(gate|up)_proj$"]), ("gate", "up")),
    ],
    ids=["awq-modules_to_not_convert", "gptq-dynamic", "gptq-modules_in_block_to_quantize", "ct-ignore-regex"],
)
def test_ignored_modules_stay_in_full_precision(models, tmp_path, name, config, skip):
    writer = {"awq": awq, "gptq": gptq, "ct": ct_int4}[name]
    quant_dir, ref_dir = write_checkpoint(models["llama"], tmp_path / "q", tmp_path / "ref", writer, config, skip)
    model = assert_matches_reference(quant_dir, ref_dir)
    for prefix, layer in model.named_modules():
        if prefix.endswith("_proj"):
            full = any(s in prefix for s in skip)
            assert hasattr(layer, "weight") == full and hasattr(layer, "qweight") != full, prefix


# -- what a user is told ---------------------------------------------------------------------------------------


def test_describe_names_the_format_and_its_settings():
    assert describe("gptq", checkpoint={**GPTQ, "desc_act": True}) == "gptq int4 (group 128, desc_act)"
    assert (
        describe("gptq", checkpoint={**GPTQ, "sym": False, "group_size": -1}) == "gptq int4 (per channel, asymmetric)"
    )
    assert describe("awq", checkpoint={**AWQ, "group_size": 64}) == "awq int4 (group 64)"
    ct = ct_config("pack-quantized", CT_INT4)
    assert describe("compressed-tensors", checkpoint=ct) == "compressed-tensors int4 (group 128, asymmetric)"
    fp8 = ct_config("float-quantized", {**CT_FP8, "strategy": "tensor"})
    assert describe("compressed-tensors", checkpoint=fp8) == "compressed-tensors fp8 (per tensor)"


@pytest.fixture(scope="module")
def gptq_dir(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    return write_checkpoint(models["llama"], root / "q", root / "ref", gptq, GPTQ)[0]


def with_config(folder, dst, **changes):
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {k: v for k, v in {**cfg["quantization_config"], **changes}.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes'.*supported: gptq, awq, compressed-tensors"),
        ({"bits": 8}, r"GPTQ bits 8 is not supported \(supported: 4\)"),
        ({"group_size": 48}, r"GPTQ group size 48 is not supported \(supported: 32, 64, 128, multiples of 32"),
        ({"group_size": 256}, r"group size 256 over 128 inputs is not one the int4 kernels run"),
        ({"checkpoint_format": "marlin"}, r"GPTQ checkpoint_format 'marlin' is not supported"),
        ({**AWQ, "version": "gemv"}, r"AWQ version 'gemv' is not supported \(supported: gemm\)"),
        ({**AWQ, "bits": 3}, r"AWQ bits 3 is not supported"),
        (
            ct_config("nvfp4-pack-quantized", {**CT_INT4, "type": "float"}),
            r"format 'nvfp4-pack-quantized' is not supported \(supported: pack-quantized, int-quantized",
        ),
        (
            ct_config("float-quantized", {**CT_FP8, "strategy": "block", "block_structure": [128, 128]}),
            r"float 8-bit float-quantized, strategy block is not supported \(supported: int4 pack-quantized",
        ),
        (ct_config("pack-quantized", {**CT_INT4, "num_bits": 2}), r"int 2-bit pack-quantized.*is not supported"),
        (
            ct_config("pack-quantized", CT_INT4, ignore=["lm_head", r"re:.*k_proj$"]),
            r"qkv_proj stacks .*q_proj.*k_proj.*v_proj, which the checkpoint quantizes differently",
        ),
    ],
)
def test_unsupported_settings_fail_at_load_naming_them(gptq_dir, tmp_path, changes, message):
    folder = with_config(gptq_dir, tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model(ModelConfig.from_path(folder, "float32"))


def test_quantization_given_for_a_checkpoint_must_be_its_own(models, gptq_dir):
    with pytest.raises(ModelLoadError, match=r"already quantized \(gptq\), so quantization 'int8' cannot apply"):
        ModelConfig.from_path(gptq_dir, quantization="int8")
    assert ModelConfig.from_path(gptq_dir, quantization="gptq").quantization == "gptq"
    assert json.loads((gptq_dir / "config.json").read_text())["quantization_config"] == GPTQ
    assert load_file(gptq_dir / "model.safetensors")["model.layers.0.mlp.up_proj.qzeros"].eq(0x77777777).all()
    assert ModelConfig.from_path(gptq_dir).quantization == "gptq"
    with pytest.raises(ModelLoadError, match=r"config.json has no quantization_config.*int8, int4, fp8"):
        ModelConfig.from_path(models["llama"], quantization="awq")


def rewrite(folder, dst, change):
    shutil.copytree(folder, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_bad_tensors_fail_naming_them(models, gptq_dir, tmp_path):
    name = "model.layers.0.self_attn.k_proj"
    writer = lambda w: gptq(w, 32, desc_act=True)  # noqa: E731 (every module's inputs in one random order)
    act_order = write_checkpoint(
        models["llama"], tmp_path / "act", tmp_path / "ref", writer, {**GPTQ, "group_size": 32}
    )

    def wrong_dtype(t):
        t[f"{name}.qweight"] = t[f"{name}.qweight"].to(torch.int16)

    def wrong_shape(t):
        t[f"{name}.scales"] = t[f"{name}.scales"][:, :8].contiguous()

    def other_order(t):  # k's inputs in another order than q's and v's, which share its input
        t[f"{name}.g_idx"] = t[f"{name}.g_idx"].flip(0).contiguous()

    for change, src, error, message in (
        (wrong_dtype, gptq_dir, WeightLoadError, rf"{name}.qweight: dtype torch.int16, gptq stores it as torch.int32"),
        (wrong_shape, gptq_dir, WeightLoadError, rf"{name}.scales: checkpoint shape \(1, 8\), model expects \(1, 64\)"),
        (other_order, act_order[0], ModelLoadError, r"q_proj and .*k_proj order their inputs differently \(g_idx\)"),
    ):
        folder = rewrite(src, tmp_path / change.__name__, change)
        with pytest.raises(error, match=message):
            load_model(ModelConfig.from_path(folder, "float32"))
