"""What a paged KV block is, for the code that moves blocks out of the pool: the runner's cache tensors with their
block axis (`cache_layout`) and the model the blocks belong to (`model_fingerprint`). P/D connectors
(engine/kv_transfer) and the offload tiers (engine/kv_offload) both compare these before they trust a block."""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

# bytes read from each weight file for the fingerprint: its head (a safetensors or GGUF header names every tensor,
# its dtype and offset) and this many evenly spaced samples of the data
_HEAD_BYTES = 1 << 16
_SAMPLES, _SAMPLE_BYTES = 16, 4096


def model_fingerprint(path: Path) -> str:
    """The model a cache belongs to: its folder's name and a hash of config.json and of each weight file's name,
    size, header and sampled bytes (cheap, and two checkpoints of one shape with other weights differ)."""
    h = xxhash.xxh3_64()
    cfg = path / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf")) + sorted(path.glob("*.bin"))
    if path.is_file():  # a single GGUF file
        files = [path]
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size};".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_HEAD_BYTES))
            for i in range(_SAMPLES):
                fh.seek(size * i // _SAMPLES)
                h.update(fh.read(_SAMPLE_BYTES))
    return f"{path.name}@{h.hexdigest()[:12]}"


def cache_layout(runner) -> tuple[list, dict]:
    """The runner's paged cache tensors with their block axis, and how a handshake or an offload directory
    describes them."""
    axis = 1 if runner.kv_cache.dim() == 4 else 2  # MLA: [layers, blocks, ...]; k/v: [2, layers, blocks, ...]
    caches = [(runner.kv_cache, axis)]
    if runner.kv_scales is not None:
        caches.append((runner.kv_scales, axis))
    layout = {
        "attention": type(runner.attn_layers[0]).__name__,
        "block_shapes": [list(c.select(a, 0).shape) for c, a in caches],
        "cache_dtypes": [str(c.dtype).removeprefix("torch.") for c, _ in caches],
    }
    return caches, layout


def free_bytes(path: str | os.PathLike) -> int:
    """Free space on the filesystem holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
