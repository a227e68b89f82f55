"""The GPU path's kernels end to end, forced on CPU (FULCRUM_ATTENTION_BACKEND=triton runs them under Triton's
interpreter): the engine gives the greedy tokens of the CPU path on the bundled model, through prefills, chunked
prefills mixed with decodes in one step, and decode-only steps. Slow per token, but a real check of the whole path."""

import pytest

from fulcrum import LLM, SamplingParams
from fulcrum.kernels.triton import BACKEND_ENV

BUNDLED = "models/tiny-shakespeare-target"
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


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8, "block_size": 4}, {"kv_cache_dtype": "int8"}])
def test_triton_kernels_give_the_cpu_paths_tokens(monkeypatch, kw):
    want, _ = greedy(monkeypatch, "torch", **kw)
    got, steps = greedy(monkeypatch, "triton", **kw)
    assert got == want
    if "max_num_batched_tokens" in kw:  # chunked prompts beside running decodes: mixed steps took the varlen kernel
        assert any(1 in s and max(s) > 1 for s in steps)
