"""Perplexity of a model on a text, and how far a quantized run's next-token distributions are from a reference
run's (the same model unquantized): mean KL divergence, its 99th percentile, top-1 agreement, perplexity ratio.

The text is tokenized once and cut into windows of `context` tokens, `stride` apart; each window's last `stride`
tokens are scored (all of the first window's), so every token is scored once, with at least context - stride tokens
before it (as Hugging Face's perplexity guide does; llama.cpp scores the second half of each chunk, stride =
context / 2). Both runs see the same windows, one full forward each, and the per-token figures are computed in
float32.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fulcrum.config import ModelConfig
from fulcrum.layers.attention import AttentionMetadata
from fulcrum.models.loader import load_model
from fulcrum.quant import describe
from fulcrum.utils.tokenizer import load_tokenizer

# the bundled model's held-out data: the last 10% of the corpus it was trained on (scripts/train_tiny.py)
DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"
HELD_OUT_FROM = 0.9


@dataclass
class RunSpec:
    """One configuration of a model to score."""

    model: str
    dtype: str = "float32"
    quantization: str | None = None
    quantization_group_size: int = 128

    def label(self) -> str:
        return f"{Path(self.model).name} {self.dtype} quantization={describe(self.quantization, self.quantization_group_size)}"

    def load(self):
        mc = ModelConfig.from_path(self.model, self.dtype, None, self.quantization, self.quantization_group_size)
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
    what the previous one did not reach, so every token after the first (which nothing predicts) is scored once."""
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


@torch.inference_mode()
def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """log-softmax of the next-token logits at every position of one sequence, float32 [n, vocab]."""
    n = ids.shape[0]
    hidden = model(ids, torch.arange(n), AttentionMetadata.for_prompts([n]))
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def evaluate(
    run: RunSpec,
    text: str,
    reference: RunSpec | None = None,
    context: int = 256,
    stride: int | None = None,
    max_windows: int | None = None,
) -> EvalResult:
    stride = stride or context // 2
    model, mc = run.load()
    ref_model = reference.load()[0] if reference is not None else None
    context = min(context, mc.max_model_len)
    stride = min(stride, context)
    tokens = load_tokenizer(mc.path).encode(text, add_special_tokens=False, verbose=False)  # no max-length warning
    ids = torch.tensor(tokens, dtype=torch.long)
    if ids.numel() < 2:
        raise ValueError("the text is shorter than two tokens")
    spans = windows(ids.numel(), context, stride)
    if max_windows:
        spans = spans[:max_windows]
    nll, ref_nll, kls, agree, scored = 0.0, 0.0, [], 0, 0
    for start, end, first in spans:
        window = ids[start:end]
        targets = ids[first:end]  # scored tokens, each predicted at the position before it
        lp = log_probs(model, window)[first - start - 1 : end - start - 1]
        nll -= lp.gather(1, targets[:, None]).sum().item()
        scored += targets.numel()
        if ref_model is not None:
            rlp = log_probs(ref_model, window)[first - start - 1 : end - start - 1]
            ref_nll -= rlp.gather(1, targets[:, None]).sum().item()
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
