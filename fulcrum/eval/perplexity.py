"""Perplexity of a model on a text, and how far a quantized run's next-token distributions are from a reference
run's (the same model unquantized): mean KL divergence, its 99th percentile, top-1 agreement, perplexity ratio.
Both runs see the same windows (`windows`) and the per-token figures are computed in float32; a quantized KV cache is
scored through the decode path, so that it shows in the figures (`evaluate`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fulcrum.config import KV_CACHE_DTYPES, ModelConfig
from fulcrum.layers.attention import Attention, AttentionMetadata, attach_kv_cache
from fulcrum.models.loader import load_model
from fulcrum.quant import describe
from fulcrum.quant import kv as kv_quant
from fulcrum.utils.tokenizer import load_tokenizer

# the bundled model's held-out data: the last 10% of the corpus it was trained on (scripts/train_tiny.py)
DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"
HELD_OUT_FROM = 0.9
DECODE_BATCH = 32  # windows decoded side by side on the decode path
BLOCK_SIZE = 16  # the decode path's KV-cache block


@dataclass
class RunSpec:
    """One configuration of a model to score."""

    model: str
    dtype: str = "float32"
    quantization: str | None = None
    quantization_group_size: int = 128
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")

    def label(self) -> str:
        kv = "" if self.kv_cache_dtype == "auto" else f" kv-cache={self.kv_cache_dtype}"
        quant = getattr(self, "_loaded_quantization", None) or describe(self.quantization, self.quantization_group_size)
        return f"{Path(self.model).name} {self.dtype} quantization={quant}" + kv

    def load(self):
        mc = ModelConfig.from_path(self.model, self.dtype, None, self.quantization, self.quantization_group_size)
        # what the checkpoint itself is quantized as (a GGUF file's types, GPTQ ...), for the label
        checkpoint = getattr(mc.hf_config, "quantization_config", None)
        object.__setattr__(
            self, "_loaded_quantization", describe(mc.quantization, mc.quantization_group_size, checkpoint)
        )
        return load_model(mc).eval(), mc


@dataclass
class EvalResult:
    run: str
    reference: str | None
    tokens_scored: int
    windows: int
    context: int
    stride: int
    perplexity: float
    reference_perplexity: float | None = None
    perplexity_ratio: float | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def held_out_text(path: Path = DEFAULT_DATA) -> str:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: give a text file with --data")
    text = path.read_text(encoding="utf-8")
    return text[int(len(text) * HELD_OUT_FROM) :]


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window over n tokens: windows start `stride` apart and score
    what the previous one did not reach, so every token after the first (which nothing predicts) is scored once, with
    at least context - stride tokens before it (as Hugging Face's perplexity guide does; llama.cpp scores the second
    half of each chunk, stride = context / 2)."""
    if not 0 < stride <= context:
        raise ValueError(f"stride must be in 1..context ({context}), got {stride}")
    out, reached = [], 1
    for start in range(0, n, stride):
        end = min(start + context, n)
        out.append((start, end, reached))
        reached = end
        if end == n:
            break
    return out


def chunk_windows(n: int, context: int) -> list[tuple[int, int, int]]:
    """llama.cpp's `llama-perplexity` windows: whole chunks of `context` tokens side by side (a tail shorter than
    one is dropped), each scoring its second half (the tokens after position context / 2), so that figures compare
    with llama.cpp's on the same tokens."""
    if context < 2:
        raise ValueError(f"a chunk must hold at least 2 tokens (--context), got {context}")
    return [(s, s + context, s + context // 2 + 1) for s in range(0, n - context + 1, context)]


@torch.inference_mode()
def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """log-softmax of the next-token logits at every position of one sequence, float32 [n, vocab]."""
    n = ids.shape[0]
    hidden = model(ids, torch.arange(n), AttentionMetadata.for_prompts([n]))
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


@torch.inference_mode()
def decode_log_probs(model, ids: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype):
    """Sequences ids [D, n] decoded side by side one token per step through a paged KV cache of `kv_cache_dtype`:
    yields each step's next-token log-softmax, float32 [D, vocab]."""
    d, n = ids.shape
    per_seq = -(-n // BLOCK_SIZE)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    attach_kv_cache(layers, d * per_seq, BLOCK_SIZE, dtype, kv_quant.kv_format(kv_cache_dtype), ids.device)
    tables = torch.arange(d * per_seq).view(d, per_seq)
    try:
        for p in range(n):
            slots = tables[:, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            meta = AttentionMetadata.for_decodes(slots, tables, torch.full((d,), p + 1))
            hidden = model(ids[:, p], torch.full((d,), p), meta)
            yield torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
    finally:
        for layer in layers:
            layer.set_cache(None, None)


def window_log_probs(model, mc, ids: torch.Tensor, group: list[tuple[int, int, int]], decode: bool, kv: str):
    """(window index in `group`, first position, log-probs [positions, vocab]) over every position of the group's
    windows (all of one length): one forward per window, or the decode path for the group at once, a step a time."""
    if not decode:
        for j, (start, end, _) in enumerate(group):
            yield j, 0, log_probs(model, ids[start:end])
        return
    batch = torch.stack([ids[start:end] for start, end, _ in group])
    for p, lp in enumerate(decode_log_probs(model, batch, kv, mc.dtype)):
        for j in range(len(group)):
            yield j, p, lp[j : j + 1]


def evaluate(
    run: RunSpec,
    text: str,
    reference: RunSpec | None = None,
    context: int = 256,
    stride: int | None = None,
    max_windows: int | None = None,
    decode: bool = False,
    chunks: bool = False,
) -> EvalResult:
    """`decode`: score through the decode path (implied when either run quantizes its KV cache): each window decoded
    one token per step as a server decodes, windows side by side in one batch, every attention reading its context
    back from a paged KV cache (the token's own k/v included). Otherwise each window is one full forward.
    `chunks`: llama-perplexity's windows (chunk_windows), each starting with BOS where the tokenizer adds one."""
    stride = stride or context // 2
    decode = decode or run.kv_cache_dtype != "auto" or (reference is not None and reference.kv_cache_dtype != "auto")
    model, mc = run.load()
    ref_model = reference.load()[0] if reference is not None else None
    context = min(context, mc.max_model_len)
    stride = min(stride, context)
    tokenizer = load_tokenizer(mc.path)
    tokens = tokenizer.encode(text, add_special_tokens=False, verbose=False)  # no max-length warning
    ids = torch.tensor(tokens, dtype=torch.long)
    if ids.numel() < 2:
        raise ValueError("the text is shorter than two tokens")
    if chunks:
        stride = context
        spans = chunk_windows(ids.numel(), context)
        if not spans:
            raise ValueError(f"the text has {ids.numel()} tokens, fewer than one chunk of {context}")
        bos = tokenizer.bos_token_id
        if bos is not None and tokenizer("a").input_ids[:1] == [bos]:
            ids[[s for s, _, _ in spans]] = bos  # as llama-perplexity, each chunk starts with BOS (never scored)
    else:
        spans = windows(ids.numel(), context, stride)
    if max_windows:
        spans = spans[:max_windows]
    nll, ref_nll, kls, agree, scored = 0.0, 0.0, [], 0, 0
    # windows of one length go together (on the decode path DECODE_BATCH at a time)
    groups = []
    for span in spans:
        same = groups and groups[-1][0][1] - groups[-1][0][0] == span[1] - span[0]
        if same and (not decode or len(groups[-1]) < DECODE_BATCH):
            groups[-1].append(span)
        else:
            groups.append([span])
    ref_kv = reference.kv_cache_dtype if reference is not None else "auto"
    for group in groups:
        lps = window_log_probs(model, mc, ids, group, decode, run.kv_cache_dtype)
        rlps = window_log_probs(ref_model, mc, ids, group, decode, ref_kv) if ref_model is not None else None
        for j, p0, lp in lps:
            rlp = next(rlps)[2] if rlps is not None else None
            start, end, first = group[j]
            # position p predicts token p + 1; each token is scored once, in the first window that reaches it
            lo, hi = max(p0, first - start - 1), min(p0 + lp.shape[0], end - start - 1)
            if lo >= hi:
                continue
            targets = ids[start + lo + 1 : start + hi + 1, None]
            lp = lp[lo - p0 : hi - p0]
            nll -= lp.gather(1, targets).sum().item()
            scored += targets.numel()
            if rlp is not None:
                rlp = rlp[lo - p0 : hi - p0]
                ref_nll -= rlp.gather(1, targets).sum().item()
                kls.append((rlp.exp() * (rlp - lp)).sum(-1).clamp(min=0))
                agree += (rlp.argmax(-1) == lp.argmax(-1)).sum().item()
    res = EvalResult(
        run=run.label(),
        reference=reference.label() if reference else None,
        tokens_scored=scored,
        windows=len(spans),
        context=context,
        stride=stride,
        perplexity=math.exp(nll / scored),
    )
    if ref_model is not None:
        kl = torch.cat(kls)
        res.reference_perplexity = math.exp(ref_nll / scored)
        res.perplexity_ratio = res.perplexity / res.reference_perplexity
        res.kl_mean = kl.mean().item()
        res.kl_p99 = kl.sort().values[min(kl.numel() - 1, int(0.99 * kl.numel()))].item()
        res.kl_max = kl.max().item()
        res.top1_agreement = agree / scored
    return res


def format_result(r: EvalResult) -> str:
    rows = [
        ("run", r.run),
        ("tokens scored", f"{r.tokens_scored:,} in {r.windows} windows of {r.context} (stride {r.stride})"),
        ("perplexity", f"{r.perplexity:.4f}"),
    ]
    if r.reference is not None:
        rows += [
            ("reference", r.reference),
            ("reference perplexity", f"{r.reference_perplexity:.4f}"),
            ("perplexity ratio", f"{r.perplexity_ratio:.5f} ({(r.perplexity_ratio - 1) * 100:+.3f}%)"),
            ("KL divergence, mean", f"{r.kl_mean:.6f} nats"),
            ("KL divergence, p99", f"{r.kl_p99:.6f} nats"),
            ("KL divergence, max", f"{r.kl_max:.6f} nats"),
            ("top-1 agreement", f"{r.top1_agreement * 100:.2f}%"),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
