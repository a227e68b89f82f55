"""Facts read off a Hugging Face config (a PretrainedConfig, or config.json as a namespace) without torch or
transformers, so `fulcrum plan` can use them as well as the models."""

from __future__ import annotations


def head_dim(hf_config) -> int:
    explicit = getattr(hf_config, "head_dim", None)
    return explicit or hf_config.hidden_size // hf_config.num_attention_heads


def layer_sliding_windows(hf_config) -> list[int | None]:
    """Per-layer sliding window (None = full attention), following `layer_types` when present."""
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    if getattr(hf_config, "use_sliding_window", True) is False:
        return [None] * n
    return [window] * n
