"""Driving an engine core by hand in tests: add a request, step until it ends."""

from __future__ import annotations

import time


def run_request(core, rid: str, ids, sp, params=None, timeout: float = 60.0):
    """Step the core until `rid` ends (or `timeout` seconds pass): (its tokens, its last output)."""
    core.add_request(rid, list(ids), sp, kv_transfer_params=params)
    toks, last = [], None
    deadline = time.time() + timeout
    while core.has_unfinished_requests() and time.time() < deadline:
        for o in core.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                last = o
    return toks, last
