"""Gemma 2 and 3 beyond the shared parity tests (tests/models/test_parity.py): that those tests can see what they
claim to check (the sliding window, the soft-caps, Gemma 3's two ropes), the paths a cap-free Gemma 2 takes, the
soft-capped attention against a float64 reference, and the configs fulcrum refuses."""

import pytest
import torch

from fulcrum.config import ModelConfig
from fulcrum.errors import ModelLoadError
from fulcrum.layers.attention import Attention
from fulcrum.models.loader import load_model
from tests.models.test_parity import hf_logits, max_diff, our_logits, prompts
from tests.tiny_models import hf_model, save_tiny_model

LENS = [5, 40, 130]  # past the sliding window (8) but for the first


def _load(folder):
    return load_model(ModelConfig.from_path(folder, dtype="float32"))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_each_layer_keeps_its_own_window_and_the_window_shows_in_the_logits(family, tmp_path):
    folder = save_tiny_model(family, tmp_path / "m")
    ours = _load(folder)
    windows = [layer.self_attn.attn.sliding_window for layer in ours.model.layers]
    assert windows == [8 if t == "sliding_attention" else None for t in ours.config.layer_types]
    # without the window (one as long as the context) transformers' logits move far beyond the parity tolerance,
    # so the parity test's agreement on prompts past 8 tokens is the window honoured layer by layer
    batch = prompts(2048, lens=LENS)
    windowed = hf_logits(hf_model(folder), batch)
    unwindowed = hf_logits(hf_model(save_tiny_model(family, tmp_path / "w", sliding_window=512)), batch)
    assert max_diff(windowed[1:], unwindowed[1:]) > 1e-2
    assert max_diff(our_logits(ours, batch), windowed) <= 1e-4


def test_soft_caps_bound_the_logits_and_bite(tmp_path):
    folder = save_tiny_model("gemma2", tmp_path / "capped")
    batch = prompts(2048, lens=LENS)
    capped = our_logits(_load(folder), batch)
    assert max(x.abs().max().item() for x in capped) < 3.0  # final_logit_softcapping
    uncapped_folder = save_tiny_model(
        "gemma2", tmp_path / "uncapped", final_logit_softcapping=None, attn_logit_softcapping=None
    )
    uncapped = our_logits(_load(uncapped_folder), batch)
    assert max_diff(capped, uncapped) > 0.1
    # without caps Gemma 2's attention takes the CPU kernels (prefill with its window too), and still matches
    assert max_diff(uncapped, hf_logits(hf_model(uncapped_folder), batch)) <= 1e-4


def test_gemma3_sliding_layers_have_a_rope_of_their_own(tmp_path):
    ours = _load(save_tiny_model("gemma3", tmp_path / "m"))
    local, glob = ours.model.rotary_emb_local, ours.model.rotary_emb
    assert local is not None and not torch.allclose(local.cos, glob.cos)
    # at position 1 the last frequency pair turns by 10000^(-15/16) locally and by 1e6^(-15/16) / 4 globally
    # (rope_local_base_freq; rope_theta with linear scaling)
    assert local.cos[1, 15].item() == pytest.approx(torch.cos(torch.tensor(10000.0 ** (-15 / 16))).item())
    assert glob.cos[1, 15].item() == pytest.approx(torch.cos(torch.tensor(1e6 ** (-15 / 16) / 4)).item())


def test_gemma3_attention_cap_is_ignored_as_transformers_ignores_it(tmp_path):
    folder = save_tiny_model("gemma3", tmp_path / "m", attn_logit_softcapping=1.0)
    ours = _load(folder)
    assert all(layer.self_attn.attn.logit_softcap is None for layer in ours.model.layers)
    batch = prompts(2048, lens=LENS)
    assert max_diff(our_logits(ours, batch), hf_logits(hf_model(folder), batch)) <= 1e-4


def test_bidirectional_attention_is_refused(tmp_path):
    folder = save_tiny_model("gemma3", tmp_path / "m", use_bidirectional_attention=True)
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        _load(folder)


def _capped_reference(q, k, v, scale, cap, window):
    """Float64 soft-capped causal attention, queries at the last positions: q [n, H, hd], k/v [m, KVH, hd]."""
    n, m, g = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k) * scale
    scores = torch.tanh(scores / cap) * cap
    q_pos, k_pos = torch.arange(m - n, m)[:, None], torch.arange(m)[None]
    allowed = (k_pos <= q_pos) & (k_pos > q_pos - window if window else True)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", probs, v)


@pytest.mark.parametrize("window", [None, 8, 200])
@pytest.mark.parametrize("n, m", [(300, 300), (37, 300), (1, 1)])
def test_capped_attention_equals_the_float64_reference(window, n, m):
    """Blocks of 128 queries, each against the keys of its window only; fresh prompts and chunks after context."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(n, 8, 32, generator=g), torch.randn(m, 2, 32, generator=g), torch.randn(m, 2, 32, generator=g)
    attn = Attention(8, 2, 32, 32**-0.5 * 3, sliding_window=window, logit_softcap=2.0)
    out = attn._attend(q, k, v)
    torch.testing.assert_close(out.double(), _capped_reference(q, k, v, 32**-0.5 * 3, 2.0, window), atol=1e-5, rtol=0)
