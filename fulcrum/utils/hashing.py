"""The block hash of prefix caching: one function, shared by the KV cache manager and the router.

A block's hash chains its parent's hash with its own token ids, so equal hashes mean equal
prefixes up to and including that block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

NONE_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    h = xxhash.xxh3_64()
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra:
        h.update(extra)
    return h.intdigest()


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, parent_hash: int = NONE_HASH) -> list[int]:
    """Chained hashes of every full block of `token_ids`."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes
