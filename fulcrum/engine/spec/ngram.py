"""N-gram prompt lookup: no model. Match the last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
against the prompt and the output so far and propose the tokens that followed the latest match. It pays where
the output copies its context (a passage repeated, edited or quoted), and costs nothing where it finds no match."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from fulcrum.engine.request import Request


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, reqs: list[Request], ks: list[int]) -> tuple[list[list[int]], None]:
        """Up to ks[i] tokens for each request (fewer where the match ends sooner, none without one); the
        proposals are deterministic (no draft distribution), hence None."""
        return [self.lookup(r.all_token_ids, k) for r, k in zip(reqs, ks)], None

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        n_tok = len(tokens)
        if k <= 0 or n_tok <= self.min_n:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            # windows that start at i and end before the last token, so at least one token follows each
            windows = sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                # the latest match: a loop or an edit in progress continues from there. Read on through the
                # proposals themselves, so a loop shorter than k proposes k tokens of itself.
                pos = int(hits[-1]) + n  # the first token after the match
                out: list[int] = []
                for m in range(k):
                    j = pos + m
                    out.append(tokens[j] if j < n_tok else out[j - n_tok])
                return out
        return []

    # no state of its own: nothing to release
    def release(self, request_ids) -> None:
        pass

    def tracked(self) -> list[str]:
        return []

    def stats(self):
        return None  # no cache
