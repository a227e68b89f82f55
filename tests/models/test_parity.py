"""Our model code gives the same logits as transformers on the same weights, and the families beyond the dense
ones (Gemma 2/3, Phi-3) the same greedy tokens through the engine however a request runs."""

import pytest
import torch

from fulcrum.config import DEFAULT_MODEL, ModelConfig
from fulcrum.layers.attention import AttentionMetadata
from fulcrum.model_folder.hf_config import head_dim
from fulcrum.models.loader import load_model
from fulcrum.plan.model_spec import kv_bytes_per_token, load_model_spec
from tests.engine.conftest import DEVICES
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_llm_parity import N_NEW, assert_all_blocks_free, greedy, make_llm, random_prompts
from tests.tiny_models import FAMILIES, MLA_FAMILIES, MORE_FAMILIES, PROMPT_MIN_LEN, hf_model, save_tiny_model

PROMPT_LENS = [1, 5, 17, 40]


def prompts(vocab: int, seed: int = 1, lens: list[int] = PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def our_logits(model, batch: list[list[int]]) -> list[torch.Tensor]:
    """One flattened forward over all prompts; logits for every position of each."""
    ids = torch.tensor([t for p in batch for t in p])
    pos = torch.tensor([i for p in batch for i in range(len(p))])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, pos, AttentionMetadata.for_prompts([len(p) for p in batch])))
    return list(logits.float().split([len(p) for p in batch]))


def hf_logits(model, batch: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float() for p in batch]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_match_transformers(family, tmp_path):
    folder = save_tiny_model(family, tmp_path / family)
    ours = load_model(ModelConfig.from_path(folder, dtype="float32"))
    theirs = hf_model(folder)
    batch = prompts(ours.config.vocab_size)
    assert max_diff(our_logits(ours, batch), hf_logits(theirs, batch)) <= 1e-4


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_more_families_float32_logits_match_transformers(family, tmp_path):
    """Gemma 2/3 and Phi-3: prompts past the sliding window (8) and, for the long LongRoPE, past the original
    context; a longer one too, many windows long."""
    folder = save_tiny_model(family, tmp_path / family)
    ours = load_model(ModelConfig.from_path(folder, dtype="float32"))
    theirs = hf_model(folder)
    lo = PROMPT_MIN_LEN.get(family, 1)
    batch = prompts(ours.config.vocab_size, lens=[max(lo, n) for n in PROMPT_LENS] + [lo + 3, 130])
    assert max_diff(our_logits(ours, batch), hf_logits(theirs, batch)) <= 1e-4


# bf16 rounds every activation to 8 bits of mantissa; the two implementations order some
# operations differently; measured differences are 1-3 bf16 ulps (about 1.5% of the largest logit).
BF16_TOL = 0.03


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3"])
def test_bfloat16_logits_close_to_transformers(family, tmp_path):
    folder = save_tiny_model(family, tmp_path / family)
    ours = load_model(ModelConfig.from_path(folder, dtype="bfloat16"))
    theirs = hf_model(folder, dtype=torch.bfloat16)
    batch = prompts(ours.config.vocab_size)
    ref32 = hf_logits(hf_model(folder), batch)
    diff = max_diff(our_logits(ours, batch), hf_logits(theirs, batch))
    scale = max(x.abs().max().item() for x in ref32)
    assert diff <= BF16_TOL * max(scale, 1.0)


def test_bundled_model_matches_transformers():
    ours = load_model(ModelConfig.from_path(DEFAULT_MODEL))
    theirs = hf_model(DEFAULT_MODEL)
    batch = prompts(ours.config.vocab_size, seed=7)
    assert max_diff(our_logits(ours, batch), hf_logits(theirs, batch)) <= 1e-4


# --- the families beyond the dense ones through the engine, as tests/engine/test_llm_parity runs the dense ones:
# MoE, Gemma, Phi-3 and DeepSeek's latent attention (whose chunked prompts reach past YaRN's original context, 128)
ENGINE_FAMILIES = [*MORE_FAMILIES, *MLA_FAMILIES]


def _prompts(family: str, count: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    lo = max(lo, PROMPT_MIN_LEN.get(family, 0))
    return random_prompts(count, lo, max(lo, hi), seed)


def assert_same_as_transformers(folder, prompt: list[int], out, device: str) -> None:
    """The engine's greedy tokens and their logprobs (which see Gemma's final soft-cap, invisible to an argmax)."""
    tokens, ref = hf_greedy(folder, prompt, len(out.token_ids), device)
    assert out.token_ids == tokens
    for tok, entry, lp in zip(tokens, out.logprobs, ref):
        assert abs(entry[tok] - lp[tok].item()) <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_alone_and_batched_match_transformers(family, device, tiny_model_dir):
    folder = tiny_model_dir(family)
    prompts = _prompts(family, 24, 3, 60, seed=1)
    llm = make_llm(folder, device)
    alone = llm.generate([prompts[0]], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(prompts, greedy(), use_tqdm=False)
    for i in [0, 1, 17, 23]:
        assert batch[i].outputs[0].token_ids == hf_greedy(folder, prompts[i], N_NEW, device)[0], f"prompt {i}"
    assert alone == batch[0].outputs[0].token_ids
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_chunked_prefill_matches(family, device, tiny_model_dir):
    """Chunks of 16 tokens in blocks of 8: every sliding window (8) straddles a chunk or a block boundary."""
    folder = tiny_model_dir(family)
    prompts = _prompts(family, 4, 40, 140 if family in MLA_FAMILIES else 120, seed=2)
    llm = make_llm(folder, device, max_num_batched_tokens=16, block_size=8)
    for p, o in zip(prompts, llm.generate(prompts, greedy(logprobs=1), use_tqdm=False)):
        assert_same_as_transformers(folder, p, o.outputs[0], device)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_after_a_prefix_cache_hit(family, device, tiny_model_dir):
    folder = tiny_model_dir(family)
    prefix = random_prompts(1, 64, 64, seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts(3, 5, 20, seed=4)]
    llm = make_llm(folder, device, block_size=16)
    llm.generate(prompts[:1], greedy(), use_tqdm=False)
    for p, o in zip(prompts[1:], llm.generate(prompts[1:], greedy(logprobs=1), use_tqdm=False)):
        assert o.metrics.num_cached_tokens == 64
        assert_same_as_transformers(folder, p, o.outputs[0], device)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_preemption_recomputes_to_the_same_tokens(family, device, tiny_model_dir):
    folder = tiny_model_dir(family)
    cfg = ModelConfig.from_path(folder).hf_config
    block_bytes = 8 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim(cfg) * 4  # fp32 k, v: 8 tokens
    if family in MLA_FAMILIES:  # one latent and a RoPE key per token, as fulcrum plan counts them
        block_bytes = 8 * int(kv_bytes_per_token(load_model_spec(folder), "fp32"))
    prompts = _prompts(family, 6, 20, 40, seed=5)
    # 20 blocks: room for about three sequences at a time, so the rest wait or get preempted mid-decode. A model
    # whose every layer slides (phi3, window 8) releases the blocks behind its window and needs fewer: 12
    windowed = getattr(cfg, "sliding_window", None) and not getattr(cfg, "layer_types", None)
    blocks, max_len = (12, 96) if windowed else (20, 160)
    llm = make_llm(folder, device, block_size=8, kv_cache_memory=blocks * block_bytes, max_model_len=max_len)
    outs = llm.generate(prompts, greedy(max_tokens=40), use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(folder, p, 40, device)[0]
    assert_all_blocks_free(llm)
