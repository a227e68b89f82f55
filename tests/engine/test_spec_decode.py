"""Speculative decoding through LLM, as a user sees it: greedy tokens identical to those without speculation (n-gram
and draft model, several k, alone and batched, the bundled pair and a tiny random pair), with chunked prefill,
prefix caching, n > 1, stops, max_tokens inside a proposal, logprobs and grammars; seeded requests reproducible;
every KV block of target and draft back after finished, aborted and preempted requests; the counters in stats()."""

import json
import re

import pytest

from fulcrum import LLM, SamplingParams
from fulcrum.config import DEFAULT_MODEL
from fulcrum.engine.spec import SpeculativeConfig
from fulcrum.errors import InvalidRequestError, ModelLoadError
from fulcrum.sampling_params import StructuredOutputsParams
from tests.engine.test_llm_parity import make_llm, random_prompts
from tests.tiny_models import save_tiny_model

DRAFT = str(DEFAULT_MODEL.parent / "tiny-shakespeare-draft")
PASSAGE = (
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"
    "And all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried."
)
PROMPTS = [
    f"Say it again.\n{PASSAGE}\n\n{PASSAGE[:40]}",  # copy-heavy: the n-gram proposer's workload
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.",
]
N_NEW = 32


# speculation at every batch size (the default policy stops it above 2 running requests on a CPU)
ALWAYS = {"disable_by_batch_size": None}


def ngram(k: int, **kw) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
        **ALWAYS,
        **kw,
    }


def draft(k: int, model: str = DRAFT, **kw) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **ALWAYS, **kw}


def greedy(max_tokens=N_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def bundled(spec=None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 32 << 20)
    return LLM(dtype="float32", speculative_config=spec, **kw)


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_no_blocks_held(llm):
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_blocks"]
    assert s["draft_num_free_blocks"] == s["draft_num_blocks"]


@pytest.fixture(scope="module")
def plain():
    return bundled()


@pytest.fixture(scope="module")
def expected(plain):
    return tokens(plain, PROMPTS, greedy())


@pytest.mark.parametrize("spec", [ngram(1), ngram(4), ngram(7), draft(1), draft(3), draft(5)], ids=str)
def test_greedy_tokens_are_those_without_speculation(spec, expected):
    llm = bundled(spec)
    assert tokens(llm, PROMPTS[:1], greedy()) == expected[:1]
    assert tokens(llm, PROMPTS, greedy()) == expected
    s = llm.stats()
    assert s["spec_num_drafts"] > 0 and s["spec_num_accepted_tokens"] > 0  # it did speculate, and it paid
    assert 1 < s["spec_mean_accepted_length"] <= 1 + spec["num_speculative_tokens"]
    assert_no_blocks_held(llm)


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir, tmp_path_factory):
    """A tiny random target and a draft of its own random weights (it disagrees: nearly every proposal rejected)."""
    target = tiny_model_dir("llama")
    other = save_tiny_model("llama", tmp_path_factory.mktemp("tiny-draft"), seed=1, num_hidden_layers=1)
    return target, other


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("kind", ["ngram", "other-draft", "self-draft"])
def test_tiny_random_pair_greedy_tokens_are_those_without_speculation(tiny_pair, kind, k):
    target, other = tiny_pair
    # random prompts that repeat themselves, so the n-gram proposer finds matches
    prompts = [p + p[: len(p) // 2] for p in random_prompts(6, 5, 40, seed=21)]
    want = tokens(make_llm(target), prompts, greedy(24))
    spec = {
        "ngram": ngram(k, prompt_lookup_min=1),
        "other-draft": draft(k, str(other)),
        "self-draft": draft(k, str(target)),
    }
    llm = make_llm(target, speculative_config=spec[kind], kv_cache_memory=32 << 20)
    assert tokens(llm, prompts[:1], greedy(24)) == want[:1]
    assert tokens(llm, prompts, greedy(24)) == want
    s = llm.stats()
    assert s["spec_num_drafts"] > 0
    if kind == "self-draft":  # the target as its own draft: every proposal kept, then the bonus token
        assert s["spec_acceptance_rate"] == 1.0
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("spec", [ngram(3), draft(3)], ids=["ngram", "draft"])
def test_chunked_prefill_prefix_cache_and_preemption_keep_the_tokens(spec, plain):
    # chunks of 32 tokens, a shared prefix found in the cache, and a cache so small that requests are preempted
    prefix = PROMPTS[0]
    prompts = [prefix + tail for tail in ["\nROMEO:", "\nJULIET:", "\nKING:", "\nQUEEN:", "\nHAMLET:", "\nLEAR:"]]
    params = greedy(48)
    want = tokens(plain, prompts, params)
    llm = bundled(spec, max_num_batched_tokens=32, block_size=8, kv_cache_memory=2 << 20, max_model_len=192)
    assert tokens(llm, prompts, params) == want
    s = llm.stats()
    assert s["prefix_cache_hits"] > 0 and s["num_preemptions"] > 0 and s["spec_num_accepted_tokens"] > 0
    assert_no_blocks_held(llm)


def test_seeded_samples_with_ngram_are_the_samples_without(plain):
    """Deterministic proposals leave a seeded request's tokens as they are without speculation (n > 1 included)."""
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=40, seed=11, ignore_eos=True)
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    llm = bundled(ngram(4))
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    assert_no_blocks_held(llm)


def test_seeded_samples_with_a_draft_are_reproducible_alone_and_batched():
    llm = bundled(draft(3))
    sp = SamplingParams(temperature=1.0, max_tokens=30, seed=5, ignore_eos=True)
    alone = tokens(llm, PROMPTS[1:2], sp)
    others = SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True)
    batched = tokens(llm, PROMPTS, [others, sp, others, others])
    assert batched[1] == alone[0]
    assert tokens(bundled(draft(3)), PROMPTS[1:2], sp) == alone
    assert llm.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("spec", [ngram(5), draft(4)], ids=["ngram", "draft"])
def test_penalties_and_min_tokens_count_the_proposals_as_output(spec, plain, expected):
    """Row j of a verification sees the j proposals before it as output: repetition, frequency and presence penalties
    and min_tokens (a stop token held back until then) give the tokens they give without speculation."""
    full = expected[0]
    params = [
        greedy(repetition_penalty=1.3),
        greedy(frequency_penalty=0.6, presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=N_NEW, min_tokens=20, stop_token_ids=[full[4], full[12]]),
    ]
    llm = bundled(spec)
    for sp in params:
        assert tokens(llm, PROMPTS, sp) == tokens(plain, PROMPTS, sp), sp
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    assert_no_blocks_held(llm)


def test_n_samples_with_a_draft_are_reproducible_and_share_no_leaked_blocks():
    """n > 1 with a draft model: n engine requests share the prompt's blocks in both caches; seeded, they give the
    same n samples in another engine, and every block comes back."""
    sp = SamplingParams(n=3, temperature=0.9, max_tokens=30, seed=3, ignore_eos=True)
    llm = bundled(draft(3))
    first = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[1:3], sp, use_tqdm=False)]
    again = [[c.token_ids for c in o.outputs] for o in bundled(draft(3)).generate(PROMPTS[1:3], sp, use_tqdm=False)]
    assert first == again
    assert all(len({tuple(t) for t in samples}) > 1 for samples in first)  # n different samples
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("spec", [ngram(5), draft(5)], ids=["ngram", "draft"])
def test_stops_and_max_tokens_inside_a_proposal(spec, plain, expected):
    llm = bundled(spec)
    full = expected[0]
    # max_tokens that end inside proposals: exactly that many tokens, the same ones
    for n in range(1, 9):
        assert tokens(llm, PROMPTS[:1], greedy(n)) == [full[:n]]
    # a stop token among accepted proposals: the output ends there
    stop_at = full[12]
    first = full.index(stop_at)
    out = llm.generate(PROMPTS[:1], greedy(stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    # a stop string: the same text as without speculation
    text = plain.generate(PROMPTS[:1], greedy(), use_tqdm=False)[0].outputs[0].text
    stop = text[20:26]
    stopped = llm.generate(PROMPTS[:1], greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.text == text[: text.index(stop)] and stopped.finish_reason == "stop"
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("spec", [ngram(5), draft(5)], ids=["ngram", "draft"])
def test_a_stop_string_inside_a_proposal_ends_ids_and_logprobs_where_it_does_without(spec, plain, monkeypatch):
    """Tokens after the one that completes a stop string are dropped (ids, logprobs, their count), however many came
    in that step: the output is the one without speculation, with the stop shown or not."""
    llm = bundled(spec)
    generated = []  # tokens the engine handed out, kept or not
    real_step = llm.core.step

    def step():
        outs = real_step()
        generated.extend(len(o.new_token_ids) for o in outs)
        return outs

    monkeypatch.setattr(llm.core, "step", step)
    full = tokens(plain, PROMPTS[:1], greedy(40))[0]
    # stops that end at several places of the output: the text of three tokens ending at token j
    stops = [plain.tokenizer.decode(full[j - 2 : j + 1]) for j in range(4, 36, 3)]
    cut = 0
    for stop in stops:
        for include in (False, True):
            sp = greedy(40, stop=[stop], logprobs=2, include_stop_str_in_output=include)
            want = plain.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0]
            generated.clear()
            got = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0]
            assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
                want.text,
                want.token_ids,
                "stop",
                stop,
            ), stop
            assert len(got.logprobs) == len(want.token_ids)
            assert [lp.keys() for lp in got.logprobs] == [lp.keys() for lp in want.logprobs]
            cut += sum(generated) > len(got.token_ids)
    assert cut > 0  # some stop came inside a step's proposals, with tokens after it to drop
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("spec", [ngram(4), draft(4)], ids=["ngram", "draft"])
def test_logprobs_are_those_of_the_accepted_tokens(spec, plain):
    sp = greedy(24, logprobs=3)
    want = plain.generate(PROMPTS, sp, use_tqdm=False)
    got = bundled(spec).generate(PROMPTS, sp, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == 24
        for we, ge in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert we.keys() == ge.keys()
            assert all(abs(we[t] - ge[t]) < 1e-4 for t in we)


@pytest.mark.parametrize("spec", [ngram(4), draft(4)], ids=["ngram", "draft"])
def test_grammars_check_the_proposals(spec, plain):
    schema = {"type": "object", "properties": {"house": {"enum": ["Montague", "Capulet"]}}, "required": ["house"]}
    grammars = [
        StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True),
        StructuredOutputsParams(regex="(ROMEO|JULIET): [a-z ]{5,30}\\."),
        StructuredOutputsParams(choice=["Montague", "Capulet"]),
    ]
    llm = bundled(spec)
    # the prompt repeats what the grammar wants, so the n-gram proposer has matches to propose
    prompts = ['Say it again.\n{"house":"Capulet"}\n{"house":"Montague"}\n', "ROMEO: what light", "JULIET:"]
    sampled = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=g) for i, g in enumerate(grammars)
    ]
    outs = [o.outputs[0].text for o in llm.generate(prompts, sampled, use_tqdm=False)]
    assert json.loads(outs[0])["house"] in ("Montague", "Capulet")
    assert re.fullmatch("(ROMEO|JULIET): [a-z ]{5,30}\\.", outs[1]), outs[1]
    assert outs[2] in ("Montague", "Capulet")
    # greedy under a grammar: the tokens it gives without speculation
    free = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=g) for g in grammars]
    assert tokens(llm, prompts, free) == tokens(plain, prompts, free)
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    assert_no_blocks_held(llm)


def test_a_long_prompts_draft_catch_up_is_spread_over_steps_within_the_budget(monkeypatch):
    """The draft prefills a prompt in chunks of at most the step's token budget (max_num_batched_tokens), beside
    requests that keep proposing; the request proposes once its draft has caught up; tokens as without."""
    budget = 32
    long_prompt = "\n".join([PASSAGE] * 4) + "\n" + PASSAGE[:60]
    prompts = [long_prompt, PROMPTS[1], PROMPTS[2]]
    kw = dict(max_num_batched_tokens=budget, block_size=8)
    want = tokens(bundled(**kw), prompts, greedy(40))
    llm = bundled(draft(3), **kw)
    forwards = []  # per draft forward: {request id: tokens computed}
    real = llm.core.speculator.proposer.runner.last_logits

    def last_logits(steps):
        forwards.append({s.request.request_id: s.num_new_tokens for s in steps})
        return real(steps)

    monkeypatch.setattr(llm.core.speculator.proposer.runner, "last_logits", last_logits)
    assert tokens(llm, prompts, greedy(40)) == want
    assert max(sum(f.values()) for f in forwards) <= budget
    n_long = len(llm.tokenizer(long_prompt)["input_ids"])
    assert n_long > 4 * budget
    long_id = "0-0"  # the first prompt's one sample
    chunked = [i for i, f in enumerate(forwards) if f.get(long_id, 0) > 4]  # more than a decode's catch-up
    assert len(chunked) >= n_long // budget and sum(forwards[i][long_id] for i in chunked) >= n_long
    # the others went on proposing while it caught up, and it proposed once it had
    assert any(len(forwards[i]) > 1 for i in chunked)
    assert sum(long_id in f for f in forwards[chunked[-1] + 1 :]) > 10
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    assert_no_blocks_held(llm)


def test_aborted_and_finished_requests_hold_no_blocks():
    llm = bundled(draft(4))
    ids = [llm.add_request(p, llm.tokenizer(p)["input_ids"], greedy(200)) for p in PROMPTS]
    for _ in range(4):
        llm.step()
    s = llm.stats()
    assert s["num_free_blocks"] < s["num_blocks"] and s["draft_num_free_blocks"] < s["draft_num_blocks"]
    for rid in ids[:2]:
        llm.abort(rid)
    while llm.core.has_unfinished_requests():
        llm.step()
    assert_no_blocks_held(llm)


def test_large_batches_do_not_speculate(expected):
    """Above disable_by_batch_size running requests a step proposes nothing; the tokens are the same."""
    llm = bundled(ngram(4, disable_by_batch_size=3))
    assert tokens(llm, PROMPTS, greedy()) == expected
    assert llm.stats()["spec_num_drafts"] == 0
    assert tokens(llm, PROMPTS[:3], greedy()) == expected[:3]
    assert llm.stats()["spec_num_drafts"] > 0
    # left out, the policy is this CPU's measured crossover: 2 running requests
    default = {k: v for k, v in ngram(4).items() if k != "disable_by_batch_size"}
    assert SpeculativeConfig.parse(default, "cpu").disable_by_batch_size == 2
    assert SpeculativeConfig.parse(default, "cuda").disable_by_batch_size is None
    llm = bundled(default)
    tokens(llm, PROMPTS[:3], greedy())
    assert llm.stats()["spec_num_drafts"] == 0
    tokens(llm, PROMPTS[:2], greedy())
    assert llm.stats()["spec_num_drafts"] > 0


def test_stats_report_acceptance():
    llm = bundled(ngram(4))
    tokens(llm, PROMPTS[:1], greedy())
    s = llm.stats()
    assert s["spec_num_draft_tokens"] >= s["spec_num_accepted_tokens"] == sum(s["spec_accepted_per_pos"])
    assert s["spec_acceptance_rate"] == s["spec_num_accepted_tokens"] / s["spec_num_draft_tokens"]
    assert s["spec_mean_accepted_length"] == 1 + s["spec_num_accepted_tokens"] / s["spec_num_drafts"]
    # acceptance falls with the position: the k-th proposal is kept only after the k - 1 before it
    per_pos = s["spec_accepted_per_pos"]
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] > 0


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model"),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 1000}, "at most 32"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_speculative_configs_name_the_problem(spec, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        bundled(spec)
    assert err.value.param == "speculative_config"


def test_a_draft_of_another_tokenizer_is_refused(tmp_path):
    other = save_tiny_model("llama", tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {f"x{t}": i for t, i in tok["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match="another tokenizer"):
        bundled(draft(2, str(other)))


def test_a_request_failing_in_a_verifying_step_ends_alone(tiny_pair, monkeypatch):
    """The failed-step retry (one request at a time) with proposals in the step: the others keep their tokens."""
    target, _ = tiny_pair
    prompts = [p + p[: len(p) // 2] for p in random_prompts(4, 10, 30, seed=23)]
    want = tokens(make_llm(target), prompts, greedy(24))
    llm = make_llm(target, speculative_config=draft(3, str(target)), kv_cache_memory=32 << 20)
    bad = [4, *prompts[1][1:]]
    real = llm.core.runner.execute

    def execute(sched):
        if any(s.request.prompt_token_ids == bad and s.spec_token_ids for s in sched.scheduled):
            raise RuntimeError("a bad input in a verifying step")
        return real(sched)

    monkeypatch.setattr(llm.core.runner, "execute", execute)
    outs = llm.generate([prompts[0], bad, *prompts[2:]], greedy(24), use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and "verifying step" in outs[1].outputs[0].error
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1] == [want[0], *want[2:]]
    assert_no_blocks_held(llm)


def test_a_failing_draft_leaves_the_step_without_proposals(tiny_pair, monkeypatch):
    target, _ = tiny_pair
    prompts = random_prompts(3, 10, 30, seed=24)
    want = tokens(make_llm(target), prompts, greedy(16))
    llm = make_llm(target, speculative_config=draft(3, str(target)), kv_cache_memory=32 << 20)
    real, calls = llm.core.speculator.proposer.runner.last_logits, []

    def last_logits(steps):
        calls.append(len(steps))
        if len(calls) % 3 == 2:  # every third draft forward fails
            raise RuntimeError("the draft failed")
        return real(steps)

    monkeypatch.setattr(llm.core.speculator.proposer.runner, "last_logits", last_logits)
    assert tokens(llm, prompts, greedy(16)) == want
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    assert_no_blocks_held(llm)
