"""Verification: which proposed tokens the target keeps, so that the output is distributed exactly as the target's.

A proposal drawn from a draft distribution q is accepted with probability min(1, p(d) / q(d)), the standard
speculative-sampling scheme (Leviathan et al. 2023, Chen et al. 2023); a deterministic one (n-gram, greedy draft) is
kept when the target's own draw matches it. A step outputs 1..s+1 tokens per request of s proposals (`verify`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fulcrum.layers.sampler import Sampler, SamplingMetadata, gather_logprobs, seeded_noise


@dataclass
class Verified:
    tokens: list[
        list[int]
    ]  # per request: the accepted proposals, then the token of the first rejected row or the bonus
    # per request: [n, 1 + max_num_logprobs] logprobs of each output token then the top k, and their ids; None if
    # no row asks for logprobs
    logprobs: list[tuple[torch.Tensor, torch.Tensor]] | None = None


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    meta: SamplingMetadata,
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    generators: list[torch.Generator | None],
) -> Verified:
    """`logits` [sum(len(d) + 1), V], each request's rows in order; `meta` has one row per logits row (its
    generators unused: `generators` has one per request); draft_probs[i] is [len(d_i), V'] (q of each proposal) or
    None (deterministic proposals).

    A request with s proposals d_1..d_s has s + 1 rows (row j scores the token after d_1..d_j; row 0 the token after
    the last one already known). Row j's distribution p_j is what the sampler would draw from there (penalties,
    grammar, temperature, top-k/p: `Sampler.prepare` and `Sampler.probs`, with d_1..d_j counted as output).

    - A proposal drawn from q (the draft model, sampling): accept d with probability min(1, p(d) / q(d)); at the
      first rejection draw from the residual max(p - q, 0), normalized, which leaves the output distributed as p.
    - A deterministic proposal (n-gram, or a greedy draft: q is one-hot at d): min(1, p(d) / 1) = p(d), and the
      residual is p without d, renormalized. Both are what drawing x ~ p and keeping d only if x == d gives, so each
      row simply draws as the sampler would and the first mismatch is the output. Greedy: the draw is the argmax.

    After all s accepted, row s gives one more token (the "bonus").

    A seeded request draws each row's noise from its own generator, row after row, and its generator is then set back
    to where it stood after the last row it used: it consumes one row of noise per output token, as without
    speculation. With deterministic proposals that makes a seeded request's tokens the very ones it samples without
    speculation; with a sampling draft they are reproducible run to run, alone or in any batch."""
    dev = logits.device
    counts = [len(d) + 1 for d in drafts]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    logits, raw_logprobs = sampler.prepare(logits, meta)
    greedy_rows = meta.temperature == 0
    x = logits.argmax(dim=-1)
    probs = noise = u = None
    # rows judged by min(1, p/q): the proposals of sampled (not greedy) requests that carry q
    greedy = greedy_rows.tolist()
    q_req = [q is not None and not greedy[offsets[i]] for i, q in enumerate(draft_probs)]
    states: dict[int, list[torch.Tensor]] = {}
    if not meta.all_greedy:
        probs = Sampler.probs(logits, meta)
        V = probs.shape[1]
        noise = torch.empty_like(probs).exponential_()
        u = torch.rand(probs.shape[0], device=dev)
        for i, gen in enumerate(generators):
            if gen is None:
                continue
            states[i] = []
            for j in range(counts[i]):
                row = offsets[i] + j
                noise[row] = seeded_noise(gen, V).to(dev)
                if q_req[i] and j < counts[i] - 1:
                    u[row] = torch.rand((), generator=gen).to(dev)
                states[i].append(gen.get_state())
        x = torch.where(greedy_rows, x, (probs / noise).argmax(dim=-1))

    # one entry per proposal: accepted or not, and the token output if this is the first rejection
    draft_rows = [offsets[i] + j for i, d in enumerate(drafts) for j in range(len(d))]
    flat = [t for d in drafts for t in d]
    accepted, replacement = [], []
    if draft_rows:
        rows_t = torch.tensor(draft_rows, device=dev)
        d_t = torch.tensor(flat, device=dev)
        acc = x[rows_t] == d_t
        rep = x[rows_t].clone()
        qi = [i for i in range(len(drafts)) if q_req[i] and drafts[i]]
        if qi:
            owner = [i for i, d in enumerate(drafts) for _ in d]
            pos = [k for k, o in enumerate(owner) if q_req[o]]
            q = torch.cat([_fit(draft_probs[i][: len(drafts[i])], probs.shape[1], dev) for i in qi])
            r = rows_t[pos]
            d = d_t[pos]
            p_rows = probs[r]
            p_d = p_rows.gather(1, d.unsqueeze(1)).squeeze(1)
            q_d = q.gather(1, d.unsqueeze(1)).squeeze(1)
            acc[pos] = u[r] * q_d < p_d
            residual = (p_rows - q).clamp(min=0)
            drawn = (residual / noise[r]).argmax(dim=-1)
            # p == q (to rounding): nothing is left to draw from, and p itself is what would be drawn
            rep[pos] = torch.where(residual.sum(dim=-1) > 0, drawn, x[r])
        accepted, replacement = acc.tolist(), rep.tolist()
    x_list = x.tolist()

    tokens, out_rows, k = [], [], 0
    for i, d in enumerate(drafts):
        out: list[int] = []
        for j, tok in enumerate(d):
            if accepted[k + j]:
                out.append(tok)
            else:
                out.append(replacement[k + j])
                break
        else:
            out.append(x_list[offsets[i] + len(d)])  # all accepted: the bonus token
        k += len(d)
        tokens.append(out)
        out_rows.append(list(range(offsets[i], offsets[i] + len(out))))
        if i in states:
            generators[i].set_state(states[i][len(out) - 1])

    result = Verified(tokens)
    if raw_logprobs is not None:
        flat_rows = torch.tensor([r for rows in out_rows for r in rows], device=dev)
        flat_tok = torch.tensor([t for out in tokens for t in out], device=dev)
        lp, ids = gather_logprobs(raw_logprobs[flat_rows], flat_tok, meta.max_num_logprobs)
        result.logprobs, start = [], 0
        for out in tokens:
            result.logprobs.append((lp[start : start + len(out)], ids[start : start + len(out)]))
            start += len(out)
    return result


def _fit(q: torch.Tensor, vocab_size: int, dev) -> torch.Tensor:
    """A draft's q over the target's vocabulary: a draft with fewer tokens has probability 0 for the rest."""
    q = q.to(dev, torch.float32)
    if q.shape[1] < vocab_size:
        q = torch.nn.functional.pad(q, (0, vocab_size - q.shape[1]))
    return q[:, :vocab_size]
