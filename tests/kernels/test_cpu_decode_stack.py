"""The fused decode stack (kernels/cpu_decode_stack.py): a decode step of Llama-shaped layers in one C++ call gives
the tokens and logprobs the layer modules give, for every layer variant it takes (biases, sliding windows, GQA and
MQA, odd head sizes, tied embeddings, int8/fp8 caches, bf16), at every row count up to the GEMV's limit and past it
(through oneDNN's packed weights where the driver can call that matmul, else the modules); models it does not fit keep
their modules."""

import time

import pytest
import torch

from fulcrum import LLM, SamplingParams
from fulcrum.kernels import cpu_decode_stack, cpu_gemv, cpu_prepack
from fulcrum.kernels.cpu_decode_stack import DecodeStack
from tests.engine.test_llm_parity import random_prompts

pytestmark = pytest.mark.skipif(not cpu_decode_stack.available(), reason="CPU kernels need AVX2 and a compiler")


def run(llm: LLM, prompts, fused: bool, max_tokens: int = 10):
    """Greedy tokens and their logprobs, with the fused stack on or off for this engine's model."""
    model = llm.core.runner.model.model
    model.fused_decode, model._stack = fused, None
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    used = isinstance(model._stack, DecodeStack)
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, lps, used


def assert_same(a, b, atol):
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=atol, rtol=0), (x, y)


@pytest.mark.parametrize("family", ["llama", "llama3-rope-tied-mqa", "llama-bias-headdim", "mistral-sliding", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_equals_the_layer_modules(family, dtype, tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir(family)), dtype=dtype, kv_cache_memory=16 << 20, block_size=8)
    limit = cpu_gemv.MAX_ROWS[cpu_gemv.level()][getattr(torch, dtype)]
    # 1 row, a few rows, and more rows than the GEMV takes (those steps run the modules, the tail fused)
    for count in (1, 5, limit + 3):
        prompts = random_prompts(count, 3, 30, seed=count)
        fused = run(llm, prompts, True)
        assert fused[2], "the fused stack was not used"
        # the same kernels in the same order: equal, bar the bf16 SwiGLU kernel's ulp against PyTorch's ops
        assert_same(fused, run(llm, prompts, False), 1e-5 if dtype == "float32" else 0.05)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_batches_decode_in_the_stack_through_the_packed_matmul(dtype, tiny_model_dir, monkeypatch):
    # qwen2: biased qkv, so the packed call's bias is exercised too
    llm = LLM(model=str(tiny_model_dir("qwen2")), dtype=dtype, kv_cache_memory=16 << 20, block_size=8)
    rows, real_run = [], DecodeStack.run
    monkeypatch.setattr(
        DecodeStack, "run", lambda self, x, *a, **k: rows.append(x.shape[0]) or real_run(self, x, *a, **k)
    )
    prompts = random_prompts(40, 3, 30, seed=7)
    fused = run(llm, prompts, True)
    stack = llm.core.runner.model.model._stack
    proj = llm.core.runner.model.model.layers[0].self_attn.qkv_proj
    packed = getattr(proj, "packed_weight", None)
    if packed is not None and cpu_prepack.c_linear(packed) is not None and packed.dtype == getattr(torch, dtype):
        assert stack.packed_rows > 0 and 40 in rows, "40 rows decoded outside the stack"
    else:  # no packed matmul the driver can call (forced AVX2's bf16 packs in fp32): the modules take those steps
        assert 40 not in rows
    assert_same(fused, run(llm, prompts, False), 1e-5 if dtype == "float32" else 0.05)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_fused_decode_reads_a_quantized_cache_as_the_modules_do(kv, tiny_model_dir):
    # no prefix caching: the second run's prompts would read the first's quantized k/v instead of computing them
    llm = LLM(
        model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory=16 << 20, kv_cache_dtype=kv,
        enable_prefix_caching=False,
    )  # fmt: skip
    prompts = random_prompts(4, 3, 40, seed=3)
    fused = run(llm, prompts, True)
    assert fused[2]
    assert_same(fused, run(llm, prompts, False), 1e-5)


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_runs_quantized_weights_as_the_modules_do(quantization, dtype, tiny_model_dir):
    """Quantized linears go through the same qgemv kernels in the stack (the integer-dot ones for bf16 rows where
    the CPU has them), at 1 row, a few, and more than those kernels take (the modules then)."""
    llm = LLM(model=str(tiny_model_dir("llama")), dtype=dtype, kv_cache_memory=16 << 20, quantization=quantization,
              quantization_group_size=32, enable_prefix_caching=False)  # fmt: skip
    for count in (1, 5, 70):
        prompts = random_prompts(count, 3, 30, seed=count)
        fused = run(llm, prompts, True)
        assert fused[2], "the fused stack was not used"
        assert_same(fused, run(llm, prompts, False), 1e-5 if dtype == "float32" else 0.05)


@pytest.mark.parametrize("family, kw", [("qwen3", {}), ("gemma2", {})])
def test_models_the_stack_does_not_fit_keep_their_modules(family, kw, tiny_model_dir):
    """q/k norms and other layer classes are not the driver's: those engines still generate."""
    llm = LLM(model=str(tiny_model_dir(family)), dtype="float32", kv_cache_memory=16 << 20, **kw)
    tokens, _, used = run(llm, random_prompts(2, 3, 20), True)
    assert not used and all(len(t) == 10 for t in tokens)


def test_enforce_eager_and_the_environment_turn_it_off(tiny_model_dir, monkeypatch):
    folder = str(tiny_model_dir("llama"))
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=16 << 20, enforce_eager=True)
    assert not llm.core.runner.model.model.fused_decode
    monkeypatch.setenv("FULCRUM_FUSED_DECODE", "0")
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=16 << 20)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not isinstance(llm.core.runner.model.model._stack, DecodeStack)


def test_the_stacks_clocks_split_its_time_by_kind_of_call_only_while_on(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory=16 << 20, block_size=8)
    prompts = random_prompts(4, 3, 30, seed=3)
    cpu_decode_stack.phase_times(True)
    t = time.perf_counter()
    tokens, _, used = run(llm, prompts, True, max_tokens=12)
    wall = time.perf_counter() - t
    on = cpu_decode_stack.phase_times(False)
    assert used
    assert set(on) == {p.lower() for p in cpu_decode_stack.PHASES}
    # every kind of call a Llama layer makes took time, and all of them together no more than the run itself
    for phase in ("norm", "qkv", "rope", "attn", "o", "gate_up", "act", "down"):
        assert on[phase] > 0, (phase, on)
    assert sum(on.values()) < wall
    # off: the clocks stay at zero, and the tokens are the same
    again, _, _ = run(llm, prompts, True, max_tokens=12)
    assert again == tokens
    assert sum(cpu_decode_stack.phase_times(False).values()) == 0
