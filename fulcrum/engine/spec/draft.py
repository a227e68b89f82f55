"""A draft model proposes: a smaller model of the same tokenizer, with its own paged KV cache, runs k steps per
engine step over all speculating requests at once (the first step catches it up on the tokens the target added
since, a prefill the first time; each further step is one decode per request). Its draft KV is valid up to what the
target accepted (`DraftModelProposer`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import torch

from fulcrum.config import EngineConfig, ModelConfig
from fulcrum.engine.kv_cache import KVCacheManager
from fulcrum.engine.model_runner import ModelRunner
from fulcrum.engine.request import Request
from fulcrum.engine.scheduler import ScheduledRequest
from fulcrum.engine.spec.config import SpeculativeConfig
from fulcrum.errors import ModelLoadError
from fulcrum.layers.sampler import Sampler, SamplingMetadata, seeded_noise

log = logging.getLogger(__name__)


class _DraftSeq:
    """A request as the draft's cache sees it: the same known tokens, the draft's own progress through them."""

    def __init__(self, req: Request):
        self.req = req
        self.request_id = req.request_id
        self.num_computed_tokens = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.req.all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.req.all_token_ids)


class DraftModelProposer:
    """The catch-up of one engine step holds at most the target's step budget (max_num_batched_tokens) of tokens: a
    long prompt's draft prefill is spread over steps, and its request decodes without proposals until the draft has
    caught up. The draft's cache holds as many blocks as the target's, in the same memory budget (the target's runner
    sizes both). After verification a request's draft progress is cut back to the target's, and the rejected
    proposals' slots are overwritten by the next catch-up, so no block leaks; a request that finishes, aborts or is
    preempted has its draft blocks freed (`release`)."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target: ModelConfig):
        mc = ModelConfig.from_path(spec.model, config.dtype)
        _check_same_tokenizer(mc, target)
        mc.max_model_len = min(mc.max_model_len, target.max_model_len)
        self.model_config = mc
        # unquantized; the cache in the target's KV dtype
        self.runner = ModelRunner(replace(config, model=spec.model, quantization=None), mc, is_draft=True)
        self.vocab_size = min(mc.hf_config.vocab_size, target.hf_config.vocab_size)
        self.kv: KVCacheManager | None = None  # once the target has sized the cache (attach)
        self.seqs: dict[str, _DraftSeq] = {}
        # tokens the draft catches up on per engine step, over all requests: the target's step budget, so that a
        # long prompt's draft prefill is chunked like the target's and a step's draft work stays bounded
        self.catch_up_budget = (
            config.max_num_batched_tokens
            if config.enable_chunked_prefill
            else max(config.max_num_batched_tokens, mc.max_model_len)
        )
        log.info("speculative decoding: draft model %s, k=%d", mc.path, spec.num_speculative_tokens)

    def attach(self, enable_prefix_caching: bool) -> None:
        """The draft's cache manager, over the blocks the target's runner gave it."""
        windows = {a.sliding_window for a in self.runner.attn_layers}
        window = None if None in windows else max(windows)
        self.kv = KVCacheManager(self.runner.num_blocks, self.runner.block_size, enable_prefix_caching, window)

    def tracked(self) -> list[str]:
        return list(self.seqs)

    def release(self, request_ids) -> None:
        for rid in request_ids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self.kv.free(seq)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """ks[i] proposals for reqs[i] (none where the draft's cache is full or its catch-up is still under way),
        and for a sampling request the draft distribution q each was drawn from ([ks[i], V]); None for a greedy one
        (its proposals are argmaxes)."""
        ks = list(ks)
        drafts: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        # the first forward: each request's catch-up, the shortest first (a decoding request's is the 1..k+1
        # tokens the target just added), within the step's budget; one left behind gets a chunk of its catch-up
        # and proposes nothing until it has caught up
        budget, steps, rows = self.catch_up_budget, [], []  # rows: the request each step proposes for, or None
        for i in sorted(range(len(reqs)), key=lambda i: self._behind(reqs[i])):
            k = min(ks[i], self.model_config.max_model_len - reqs[i].num_tokens)
            ks[i] = 0
            seq, n, whole = self._ready(reqs[i], k, budget)
            if seq is None:
                continue
            budget -= n
            steps.append(ScheduledRequest(seq, n, [], []))
            rows.append(i if whole else None)
            if whole:
                ks[i] = k
        active = [i for i in rows if i is not None]
        for j in range(max((ks[i] for i in active), default=1) if steps else 0):
            if j:  # one decode per request still drafting: its last proposal in, the next out
                active = [i for i in active if ks[i] > j]
                steps = [ScheduledRequest(self.seqs[reqs[i].request_id], 1, [], drafts[i]) for i in active]
                rows = active
            for s in steps:
                s.block_table = self.kv.block_table(s.request.request_id)
            logits = self.runner.last_logits(steps)[:, : self.vocab_size]
            for s in steps:
                s.request.num_computed_tokens += s.num_new_tokens
            drawing = [r for r, i in enumerate(rows) if i is not None]
            if not drawing:
                continue
            tokens, probs = self._draw(logits[drawing], [reqs[rows[r]] for r in drawing])
            for t, r in enumerate(drawing):
                i = rows[r]
                drafts[i].append(tokens[t])
                if probs is not None and not reqs[i].sampling_params.greedy:
                    qs[i].append(probs[t])
        return drafts, [torch.stack(q) if q else None for q in qs]

    def _behind(self, req: Request) -> int:
        """Tokens the draft has still to compute for `req` (its whole context the first time)."""
        seq = self.seqs.get(req.request_id)
        done = min(seq.num_computed_tokens, req.num_computed_tokens) if seq is not None else 0
        return req.num_tokens - done

    def _ready(self, req: Request, k: int, budget: int) -> tuple[_DraftSeq | None, int, bool]:
        """The request's draft sequence with its progress cut back to the target's and room for the tokens it
        computes now: its whole catch-up and k - 1 more proposals' KV when the catch-up fits `budget` (then True),
        else a chunk of `budget` tokens of it (False). (None, 0, False) when there is neither budget nor room in
        the draft's cache: it does not propose this step."""
        if k <= 0:
            return None, 0, False
        seq = self.seqs.get(req.request_id)
        computed, cached = [], 0
        if seq is None:
            seq = _DraftSeq(req)
            computed, cached = self.kv.get_computed_blocks(seq)
        else:
            # the proposals the target rejected: their KV is past here and gets overwritten
            seq.num_computed_tokens = min(seq.num_computed_tokens, req.num_computed_tokens)
            self.kv.release_out_of_window(seq)
        catch_up = seq.num_tokens - seq.num_computed_tokens - cached
        whole = catch_up <= budget
        n = catch_up if whole else budget
        if n <= 0 or not self.kv.allocate_slots(seq, n + k - 1 if whole else n, computed):
            if req.request_id not in self.seqs:
                self.kv.free(seq)  # the prefix hashes it looked up
            return None, 0, False
        seq.num_computed_tokens += cached
        self.seqs[req.request_id] = seq
        return seq, n, whole

    @staticmethod
    def _draw(logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], torch.Tensor | None]:
        """Each request's next proposal: the argmax for a greedy request, else a draw from the draft's distribution
        at the request's temperature, top-k and top-p (any q keeps the output exact; one nearer the target's
        is accepted more often), from the request's own generator when seeded."""
        params = [r.sampling_params for r in reqs]
        argmax = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return argmax.tolist(), None
        dev, V = logits.device, logits.shape[1]
        temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=dev)
        meta = SamplingMetadata(temperature=temps, all_greedy=False)
        if any(p.top_p < 1 for p in params):
            meta.top_p = torch.tensor([p.top_p for p in params], device=dev)
        if any(0 < p.top_k < V for p in params):
            meta.top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=dev)
        probs = Sampler.probs(logits.float(), meta)
        noise = torch.empty_like(probs).exponential_()
        for row, r in enumerate(reqs):
            if r.generator is not None and not params[row].greedy:
                noise[row] = seeded_noise(r.generator, V).to(dev)
        tokens = torch.where(temps == 0, argmax, (probs / noise).argmax(dim=-1))
        return tokens.tolist(), probs

    def stats(self):
        return self.kv.stats()


def _check_same_tokenizer(draft: ModelConfig, target: ModelConfig) -> None:
    """Proposals are token ids: the draft must read and write the target's tokens."""
    files = [m.path / "tokenizer.json" for m in (draft, target)]
    if all(f.exists() for f in files):
        vocabs = [json.loads(f.read_text()).get("model", {}).get("vocab") for f in files]
        if vocabs[0] != vocabs[1]:
            raise ModelLoadError(
                f"the draft model {draft.path} has another tokenizer than the target {target.path}; speculative "
                "decoding needs a draft of the same vocabulary"
            )
