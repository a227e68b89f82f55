"""Our rotary tables equal transformers' for every rope scaling type it defines, at every position of the context."""

import math

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from fulcrum.config import rope_parameters
from fulcrum.layers.rotary import SUPPORTED_ROPE_TYPES, RotaryEmbedding, inverse_frequencies
from fulcrum.model_folder.hf_config import head_dim

MAX_POS = 256
SCALINGS = {
    "default": None,
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    "yarn-mscale": dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.5
    ),
    "longrope": dict(
        rope_type="longrope",
        short_factor=[1.0 + i / 8 for i in range(16)],
        long_factor=[1.0 + i for i in range(16)],
        original_max_position_embeddings=64,
    ),
    "llama3": dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    ),
}


def _tables(cfg, reference_cls):
    """(ours, transformers') cos and sin over the whole context; ours with rotate-half's sign taken out of sin."""
    ours = RotaryEmbedding(head_dim(cfg), cfg.max_position_embeddings, rope_parameters(cfg))
    half = head_dim(cfg) // 2
    sign = torch.cat((-torch.ones(half), torch.ones(half)))
    positions = torch.arange(cfg.max_position_embeddings)
    cos, sin = ours(positions, torch.float32)
    ref_cos, ref_sin = reference_cls(cfg)(torch.zeros(1), positions[None])
    return (cos[:, 0], sin[:, 0] * sign), (ref_cos[0], ref_sin[0])


@pytest.mark.parametrize("name", SCALINGS)
def test_tables_equal_transformers(name):
    cfg = LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=MAX_POS, rope_theta=50000.0,
        rope_scaling=SCALINGS[name],
    )  # fmt: skip
    (cos, sin), (ref_cos, ref_sin) = _tables(cfg, LlamaRotaryEmbedding)
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)


def test_every_transformers_rope_type_is_supported():
    assert {"default", "linear", "dynamic", "yarn", "longrope", "llama3"} <= set(SUPPORTED_ROPE_TYPES)


@pytest.mark.parametrize("original, expected", [(256, "short"), (64, "long")])
def test_longrope_takes_the_long_factors_when_the_context_exceeds_the_original(original, expected):
    """Phi-3's convention: original_max_position_embeddings at the top of the config. The choice is made once for
    the model (see inverse_frequencies), where transformers makes it per forward call by the call's length."""
    short, long = [1.0] * 8, [4.0] * 8
    cfg = Phi3Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=256, original_max_position_embeddings=original,
        rope_scaling=dict(rope_type="longrope", short_factor=short, long_factor=long),
    )  # fmt: skip
    inv_freq, factor = inverse_frequencies(16, 256, rope_parameters(cfg))
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(inv_freq, base / (4.0 if expected == "long" else 1.0))
    # the attention factor comes from the context's ratio to the original, whichever factors are taken
    assert factor == pytest.approx(math.sqrt(1 + math.log(256 / original) / math.log(original)))
    # against transformers where it takes the same factors: over a sequence the length of the whole context
    (cos, sin), (ref_cos, ref_sin) = _tables(cfg, Phi3RotaryEmbedding)
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)


def test_partial_rotation_and_unknown_types_are_refused():
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        inverse_frequencies(16, 64, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="supported: default, linear"):
        inverse_frequencies(16, 64, {"rope_type": "mystery", "rope_theta": 1e4})
