"""With speculation the engine samples from the target's distribution, exactly: on a model of 6 tokens, the joint
frequencies of the first three output tokens (the first drawn after the prompt, the next two verified against
proposals) match the target's softmax, by chi-square at significance ALPHA, for a draft model that disagrees with
the target and for n-gram proposals; the same samples reject what a sampler that kept the draft's tokens would give,
so the test can tell."""

import itertools

import pytest
import torch

from fulcrum import LLM, SamplingParams
from tests.engine.test_spec_rejection import ALPHA, chi_square_p_value
from tests.tiny_models import save_tiny_model

V = 6
PROMPT = [1, 3, 4, 0, 5, 3, 4, 2, 1]
N = 12000  # samples: 216 cells, about 55 per cell on average


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-dist")
    return save_tiny_model("llama", root / "target", vocab_size=V), save_tiny_model(
        "llama", root / "draft", seed=1, vocab_size=V
    )


def joint(folder) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) of a model at temperature 1, from its full next-token distributions."""
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=16 << 20)
    prefixes = [[]] + [[a] for a in range(V)] + [[a, b] for a in range(V) for b in range(V)]
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=V, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT + p} for p in prefixes], sp, use_tqdm=False)
    dist = {}
    for p, o in zip(prefixes, outs):
        entry = o.outputs[0].logprobs[0]
        dist[tuple(p)] = torch.tensor([entry[t] for t in range(V)], dtype=torch.float64).exp()
    probs = torch.zeros(V, V, V, dtype=torch.float64)
    for a, b, c in itertools.product(range(V), repeat=3):
        probs[a, b, c] = dist[()][a] * dist[(a,)][b] * dist[(a, b)][c]
    return probs.flatten()


def counts(folder, spec) -> tuple[torch.Tensor, dict]:
    # blocks of 4: every request after the first finds all but the last token of the prompt in the prefix cache (and
    # the draft, all but that and the first output token): they run as decode rows, not as a prefill each
    llm = LLM(
        model=str(folder),
        dtype="float32",
        kv_cache_memory=32 << 20,
        max_num_seqs=256,
        block_size=4,
        speculative_config=spec,
    )
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=i, ignore_eos=True) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    cells = torch.tensor([(lambda t: t[0] * V * V + t[1] * V + t[2])(o.outputs[0].token_ids) for o in outs])
    return torch.bincount(cells, minlength=V**3), llm.stats()


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_token_frequencies_match_the_target(pair, method):
    target, draft = pair
    if method == "draft_model":
        spec = {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": 2,
            "disable_by_batch_size": None,
        }
    else:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
            "disable_by_batch_size": None,
        }
    observed, stats = counts(target, spec)
    p = joint(target)
    assert chi_square_p_value(observed, p) > ALPHA
    # speculation did happen, and both ways: proposals kept and proposals rejected
    assert stats["spec_num_drafts"] > N / 2
    assert 0.1 < stats["spec_acceptance_rate"] < 0.9
    if method == "draft_model":
        # a sampler that kept every proposal would have drawn t2 and t3 from the draft: these samples reject that
        q = joint(draft).view(V, V, V)
        t1 = p.view(V, V, V).sum(dim=(1, 2))
        kept = (t1.view(V, 1, 1) * q / q.sum(dim=(1, 2), keepdim=True)).flatten()
        assert chi_square_p_value(observed, kept) < 1e-9
