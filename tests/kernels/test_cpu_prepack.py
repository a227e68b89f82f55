"""The packed weights, fulcrum's blocked layout and oneDNN's: the same outputs as F.linear at every row count and
level (bf16 kept in bf16 in fulcrum's layout, widened to fp32 for oneDNN's where torch has no native bf16 matmul), each
layout where it applies, the GEMV kept for few rows, and nothing packed below avx2 or when turned off."""

import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.kernels import cpu_prepack
from fulcrum.quant.base import UnquantizedLinearMethod
from fulcrum.utils import cpu_isa

needs_packing = pytest.mark.skipif(not cpu_prepack.supported(), reason="avx2 or above (FULCRUM_CPU_ISA) and oneDNN")


def _layer(out_features, in_features, dtype):
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(out_features, in_features, dtype=dtype) * 0.05, requires_grad=False)
    method = UnquantizedLinearMethod()
    method.process_weights_after_loading(layer)
    method.pack_small(layer)  # finish_loading's second pass
    return layer, method


@needs_packing
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 4, 5, 9, 16, 300, 600])
@pytest.mark.parametrize("layout", ["fulcrum", "onednn"])
def test_packed_linear_matches_f_linear(dtype, rows, layout, monkeypatch):
    torch.manual_seed(rows)
    if layout == "onednn":
        monkeypatch.setattr(cpu_prepack, "blocks", lambda weight: False)
    layer, method = _layer(1152, 896, dtype)
    assert layer.packed_weight is not None
    assert cpu_prepack.is_blocked(layer.packed_weight) == (layout == "fulcrum" and cpu_prepack.blocks(layer.weight))
    assert layer.packed_weight.dtype == (dtype if layout == "fulcrum" else cpu_prepack._onednn_dtype(dtype))
    bias = torch.randn(1152, dtype=dtype)
    x = torch.randn(rows, 896, dtype=dtype)
    got = method.apply(layer, x, bias)
    want = F.linear(x.float(), layer.weight.float(), bias.float())
    assert got.dtype == dtype and got.shape == (rows, 1152)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # leading dims are kept, as F.linear keeps them
    assert method.apply(layer, x.reshape(1, rows, 896), None).shape == (1, rows, 1152)


def test_bf16_stays_bf16_in_fulcrums_layout_and_is_widened_for_onednns_without_native_bf16_matmuls():
    """A bf16 weight whose rows fill fulcrum's tiles is packed in bf16 at every level (widened in registers below
    AVX-512 BF16: half the bytes of an fp32 copy); one that does not (40 rows) takes oneDNN's copy, in fp32 where
    torch has no native bf16 matmul; the dtype the probe reports is the packed one."""
    code = (
        "import torch; from fulcrum.kernels import cpu_prepack as c; "
        "print(*[c.pack(torch.randn(o, 64, dtype=torch.bfloat16)).dtype for o in (64, 40)], "
        "c.packed_dtype(torch.bfloat16))"
    )
    levels = cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(cpu_isa.detected_isa()) + 1]
    bf16, fp32 = "torch.bfloat16", "torch.float32"
    for level, want in [("avx2", [bf16, fp32, bf16]), ("avx512", [bf16, fp32, bf16]),
                        ("avx512_bf16", [bf16, bf16, bf16])]:  # fmt: skip
        if level in levels:
            # torch's caps come from the level alone, not from a level this test runs under
            env = {k: v for k, v in os.environ.items() if k not in cpu_isa.TORCH_ISA_ENV["none"]}
            env["FULCRUM_CPU_ISA"] = level
            res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            assert res.returncode == 0, res.stderr
            assert res.stdout.split() == want, level


@pytest.mark.skipif(not cpu_isa.torch_at_least("avx512_bf16"), reason="packs bf16 natively only from avx512_bf16")
def test_a_weight_onednn_refuses_to_pack_stays_unpacked():
    """ONEDNN_MAX_CPU_ISA set by hand below what oneDNN's bf16 packing needs: the layer keeps the plain path."""
    code = (
        "import torch; from fulcrum.kernels import cpu_prepack; "
        "print(cpu_prepack.pack(torch.randn(64, 64, dtype=torch.bfloat16)) is None)"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "FULCRUM_CPU_BLOCKED": "0"}  # oneDNN's layout, not fulcrum's
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True"]


def test_each_weight_takes_the_layout_its_level_and_shape_allow():
    """fulcrum's blocked layout for fp32 and bf16 at every level (bf16 not at AMX), where the rows fill its tiles;
    oneDNN's for the rest (bf16 at AMX; rows that do not fill a tile)."""
    code = (
        "import torch; from fulcrum.kernels import cpu_prepack as c; "
        "print(*[c.is_blocked(c.pack(torch.randn(o, 64, dtype=d))) for d in (torch.float32, torch.bfloat16) "
        "for o in (64, 40)])"
    )
    levels = cpu_isa.ISA_LEVELS[cpu_isa.ISA_LEVELS.index("avx2") : cpu_isa.ISA_LEVELS.index(cpu_isa.detected_isa()) + 1]
    for level in levels:
        env = {k: v for k, v in os.environ.items() if k not in cpu_isa.TORCH_ISA_ENV["none"]}
        env["FULCRUM_CPU_ISA"] = level
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        # fp32 64 rows, fp32 40 rows (a tile of 16 at AVX2 does not divide it either), bf16 64, bf16 40
        want = ["True", "False", str(level != "amx"), "False"]
        assert res.stdout.split() == want, level


@needs_packing
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
@pytest.mark.parametrize("level", ["avx2", "avx512", "amx"])
def test_fp32_prefill_rows_take_blas_where_it_beat_the_blocked_kernel(level, vendor, monkeypatch):
    """At AVX-512 and above on Intel an fp32 linear of BLAS_ROWS rows or more (prefill) goes to torch's sgemm on the
    plain weight, fewer rows to the blocked copy; at AVX2, where the two were level, and on AMD, where MKL runs no
    AVX-512 kernel, every row count takes the copy."""
    monkeypatch.setattr(cpu_isa, "isa", lambda: level)
    monkeypatch.setattr(cpu_isa, "vendor", lambda: vendor)
    # a cache of its own, read at this level (the module's keeps the real one)
    monkeypatch.setattr(cpu_prepack, "blas_rows", functools.cache(cpu_prepack.blas_rows.__wrapped__))
    layer, method = _layer(64, 48, torch.float32)
    assert cpu_prepack.is_blocked(layer.packed_weight)
    calls = []
    blocked = cpu_prepack.linear
    monkeypatch.setattr(cpu_prepack, "linear", lambda *a: calls.append(a[0].shape[0]) or blocked(*a))
    torch.manual_seed(0)
    for rows in (8, 511, 512, 2048):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(method.apply(layer, x, None), F.linear(x, layer.weight), atol=1e-4, rtol=1e-4)
    blas = level != "avx2" and vendor == "GenuineIntel"
    assert calls == ([8, 511] if blas else [8, 511, 512, 2048])


@needs_packing
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [2, 7, 8, 9, 13, 64])
def test_blocked_layout_with_bias_and_row_groups(dtype, rows):
    """fulcrum's kernel over several tiles and row groups (8 rows a pass at AVX-512, 6 at AVX2, and the rest), with a
    bias, equals F.linear; it keeps x's leading dims."""
    weight = torch.randn(96, 70, dtype=dtype) * 0.1
    if not cpu_prepack.blocks(weight):
        pytest.skip(f"{dtype} takes oneDNN's layout at this level")
    packed = cpu_prepack.pack(weight)
    assert cpu_prepack.is_blocked(packed)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, 70, dtype=dtype), torch.randn(96, dtype=dtype)
    got = cpu_prepack.linear(x, packed, bias)
    want = F.linear(x.float(), weight.float(), bias.float())
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(cpu_prepack.linear(x.reshape(1, rows, 70), packed, None).float()[0],
                               F.linear(x.float(), weight.float()), atol=tol, rtol=tol)  # fmt: skip


@needs_packing
def test_a_weight_that_would_not_fit_stays_unpacked(monkeypatch):
    monkeypatch.setattr(cpu_prepack, "_mem_available", lambda: cpu_prepack.RESERVE_BYTES)
    layer, method = _layer(64, 64, torch.bfloat16)
    assert layer.packed_weight is None
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(method.apply(layer, x, None), F.linear(x, layer.weight))


@pytest.mark.parametrize("env", [{"FULCRUM_CPU_ISA": "none"}, {"FULCRUM_CPU_PREPACK": "0"}])
def test_nothing_is_packed_below_avx2_or_when_turned_off(env):
    code = (
        "import torch; from fulcrum.kernels import cpu_prepack; "
        "print(cpu_prepack.supported(), cpu_prepack.pack(torch.randn(64, 64, dtype=torch.bfloat16)) is None)"
    )
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "True"]


@needs_packing
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_steps_past_the_stacks_rows_go_to_the_packed_weights(dtype, tiny_model_dir, monkeypatch):
    """With packed weights, decode steps wider than the GEMV wins at take the packed matmul: inside the fused stack
    where its driver calls that matmul (packed_linear.cpp; every decode step is the stack's), else through the
    modules past STACK_ROWS; either way the tokens are the stack-less engine's."""
    from fulcrum import LLM, SamplingParams
    from fulcrum.kernels.cpu_decode_stack import MAX_ROWS, DecodeStack
    from tests.engine.test_llm_parity import random_prompts

    folder = str(tiny_model_dir("llama"))
    prompts = random_prompts(cpu_prepack.stack_rows(getattr(torch, dtype)) + 4, 3, 30, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=folder, dtype=dtype, kv_cache_memory=16 << 20, block_size=8)
    model = llm.core.runner.model.model
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    few = [o.outputs[0].token_ids for o in llm.generate(prompts[:5], sp, use_tqdm=False)]  # a step of 5 rows
    assert isinstance(model._stack, DecodeStack)
    packed = model.layers[0].mlp.down_proj.packed_weight
    in_driver = cpu_prepack.c_linear(packed) is not None and packed.dtype == getattr(torch, dtype)
    if in_driver:
        assert model._stack.max_rows == MAX_ROWS
        assert model._stack.packed_rows == cpu_prepack.min_rows(getattr(torch, dtype))
    else:
        assert model._stack.max_rows == cpu_prepack.stack_rows(getattr(torch, dtype))
        assert model._stack.packed_rows == 0
    # at AMX a bf16 step of 2 to SMALL_ROWS rows takes the blocked copies in the driver too
    small = cpu_isa.isa() == "amx" and dtype == "bfloat16" and in_driver
    assert model._stack.small_rows == (cpu_prepack.SMALL_ROWS if small else 0)
    model.fused_decode, model._stack = False, None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == got
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:5], sp, use_tqdm=False)] == few

    monkeypatch.setattr(cpu_prepack, "pack", lambda weight: None)  # unpacked weights: the stack keeps its GEMV rows
    llm = LLM(model=folder, dtype=dtype, kv_cache_memory=16 << 20, block_size=8)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    assert llm.core.runner.model.model._stack.max_rows > cpu_prepack.stack_rows(getattr(torch, dtype))


@needs_packing
@pytest.mark.skipif(cpu_isa.isa() != "amx", reason="the amx level only")
def test_amx_gives_a_bf16_weight_a_blocked_copy_for_few_rows(monkeypatch):
    """At AMX a bf16 weight is packed twice: oneDNN's layout (its AMX tiles) for many rows, fulcrum's for 2 to
    SMALL_ROWS rows, where its blocked kernel beat the tiles on cold weights; the linear is F.linear's either way."""
    layer, method = _layer(128, 96, torch.bfloat16)
    assert not cpu_prepack.is_blocked(layer.packed_weight) and cpu_prepack.is_blocked(layer.small_weight)
    took, real = [], cpu_prepack.linear
    monkeypatch.setattr(
        cpu_prepack, "linear", lambda x, p, b=None: took.append(cpu_prepack.is_blocked(p)) or real(x, p, b)
    )
    bias = torch.randn(128, dtype=torch.bfloat16)
    for rows in (1, 2, cpu_prepack.SMALL_ROWS, cpu_prepack.SMALL_ROWS + 1, 64):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        want = F.linear(x.float(), layer.weight.float(), bias.float())
        torch.testing.assert_close(method.apply(layer, x, bias).float(), want, atol=3e-2, rtol=3e-2)
    assert took == [True, True, False, False]  # 1 row: the GEMV; 2 and SMALL_ROWS: the copy; past it: oneDNN's


def test_no_small_copy_below_amx_or_when_turned_off():
    code = (
        "import torch; from fulcrum.kernels import cpu_prepack as c; "
        "print(c.pack_small(torch.randn(64, 64, dtype=torch.bfloat16)) is not None, "
        "c.pack_small(torch.randn(64, 64)) is not None)"
    )
    levels = cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(cpu_isa.detected_isa()) + 1]
    for level, extra in [*((lv, {}) for lv in levels), *([("amx", {"FULCRUM_CPU_SMALL": "0"})] * ("amx" in levels))]:
        env = {k: v for k, v in os.environ.items() if k not in cpu_isa.TORCH_ISA_ENV["none"]}
        env.update(FULCRUM_CPU_ISA=level, **extra)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        # bf16 at AMX only (fp32 never: fulcrum's layout is its only packed one)
        assert res.stdout.split() == [str(level == "amx" and not extra), "False"], (level, extra)


@needs_packing
@pytest.mark.skipif(cpu_isa.isa() != "amx", reason="the amx level only")
def test_the_copies_for_few_rows_come_after_every_packed_weight(tiny_model_dir, monkeypatch):
    """Where memory runs short the small copies are the ones left out: every layer's packed weight is made first."""
    from fulcrum import LLM

    order, real_pack, real_small = [], cpu_prepack.pack, cpu_prepack.pack_small
    monkeypatch.setattr(cpu_prepack, "pack", lambda w: order.append("pack") or real_pack(w))
    monkeypatch.setattr(cpu_prepack, "pack_small", lambda w: order.append("small") or real_small(w))
    llm = LLM(model=str(tiny_model_dir("llama")), dtype="bfloat16", kv_cache_memory=16 << 20, block_size=8)
    assert "small" in order and "pack" not in order[order.index("small") :]
    proj = llm.core.runner.model.model.layers[0].mlp.down_proj
    assert proj.packed_weight is not None and cpu_prepack.is_blocked(proj.small_weight)
