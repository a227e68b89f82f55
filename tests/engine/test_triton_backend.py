"""The GPU path's kernels end to end, forced on CPU (FULCRUM_ATTENTION_BACKEND=triton runs them under Triton's
interpreter): the engine gives the greedy tokens of the CPU path on the bundled model, through prefills, chunked
prefills mixed with decodes in one step, and decode-only steps. Slow per token, but a real check of the whole path."""

import pytest

from fulcrum import LLM, SamplingParams
from fulcrum.config import DEFAULT_MODEL
from fulcrum.kernels.triton import BACKEND_ENV, decode_attention, prefill_attention

KERNELS = {"decode": (decode_attention, "paged_decode"), "prefill": (prefill_attention, "paged_prefill")}


def count_kernel_calls(monkeypatch) -> dict[str, int]:
    """Calls of the attention kernels from here on (so that a run that never reached them cannot pass)."""
    calls = dict.fromkeys(KERNELS, 0)
    for name, (module, fn) in KERNELS.items():
        kernel = getattr(module, fn)

        def counted(*args, _name=name, _kernel=kernel, **kw):
            calls[_name] += 1
            return _kernel(*args, **kw)

        monkeypatch.setattr(module, fn, counted)
    return calls


BUNDLED = str(DEFAULT_MODEL)
PROMPTS = ["ROMEO:", "To be, or not to be, that is the question:", "KING HENRY:\nOnce more unto the breach"]


def greedy(monkeypatch, backend: str, **kw) -> list[list[int]]:
    monkeypatch.setenv(BACKEND_ENV, backend)
    llm = LLM(model=BUNDLED, dtype="float32", device="cpu", kv_cache_memory=16 << 20, seed=0, **kw)
    steps = []
    execute = llm.core.runner.execute

    def recorded(out):
        steps.append(sorted(s.num_new_tokens for s in out.scheduled))
        return execute(out)

    llm.core.runner.execute = recorded
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return tokens, steps


@pytest.mark.parametrize(
    "kw",
    [
        {"max_num_batched_tokens": 8, "block_size": 4},  # every kind of step: prefill, mixed, decode-only
        pytest.param({}, marks=pytest.mark.slow),
        pytest.param({"kv_cache_dtype": "int8"}, marks=pytest.mark.slow),
    ],
)
def test_triton_kernels_give_the_cpu_paths_tokens(monkeypatch, kw):
    want, _ = greedy(monkeypatch, "torch", **kw)
    calls = count_kernel_calls(monkeypatch)
    got, steps = greedy(monkeypatch, "triton", **kw)
    assert got == want
    assert calls["decode"] > 0 and calls["prefill"] > 0
    if "max_num_batched_tokens" in kw:  # chunked prompts beside running decodes: mixed steps took the varlen kernel
        assert any(1 in s and max(s) > 1 for s in steps)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral-sliding", "qwen3", "gemma2", "mixtral", "deepseek-v3-moe"])
def test_each_family_through_the_triton_kernels(monkeypatch, family, tiny_model_dir):
    """Sliding windows, q/k norms, Gemma's soft cap and norms, MoE's grouped GEMM and MLA's latent decode, each
    through the Triton kernels under the interpreter: the CPU path's greedy tokens."""
    folder = tiny_model_dir(family)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(backend):
        monkeypatch.setenv(BACKEND_ENV, backend)
        llm = LLM(model=str(folder), dtype="float32", device="cpu", kv_cache_memory=8 << 20, seed=0)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    want = run("torch")
    calls = count_kernel_calls(monkeypatch)
    assert run("triton") == want
    assert calls["decode"] > 0
