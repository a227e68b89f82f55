"""The cost of structured output: decode step time with every row under a JSON-schema grammar against the same
batch without grammars (batch 1 and 32), the bitmask's fill and apply time per step, and schema compile time (the
tests' 36 schemas, cold and from the compiler's cache).

Baseline, in the same run: the same requests without a grammar (eos ignored so that they decode as long).
`--vocab 32000` trains a byte-level BPE tokenizer of that size on the Shakespeare corpus and gives it a
random-weight model of the bundled shape: mask cost grows with the vocabulary, and the bundled one has 2,048 tokens.

    .venv/bin/python benchmarks/bench_structured_output.py
    .venv/bin/python benchmarks/bench_structured_output.py --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import BUNDLED, REPO, cpu_summary, print_table  # noqa: E402
from fulcrum.engine.llm import LLM  # noqa: E402
from fulcrum.engine.structured import StructuredOutputs  # noqa: E402
from fulcrum.layers.sampler import apply_token_bitmask  # noqa: E402
from fulcrum.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

# long outputs, so that every row is still decoding for all the measured steps
LONG = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40, "maxItems": 40}
CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def big_vocab_model(vocab: int, folder: Path) -> Path:
    if (folder / "config.json").exists():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = CORPUS.read_text()
    # the corpus alone has too few distinct words for a large vocabulary: add its words' pairs
    words = text.split()
    tok.train_from_iterator([text, " ".join(a + b for a, b in zip(words, words[1:]))], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    cfg = AutoConfig.from_pretrained(BUNDLED)
    cfg.vocab_size = len(fast)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = fast.eos_token_id
    cfg.eos_token_id = fast.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def step_times(llm: LLM, batch: int, grammar: bool, steps: int) -> list[float]:
    """Seconds of each decode step while all `batch` rows run (the prefill step and the first decode left out)."""
    so = StructuredOutputsParams(json=LONG) if grammar else None
    for i in range(batch):
        p = SamplingParams(temperature=1.0, seed=i, max_tokens=steps + 2, structured_outputs=so, ignore_eos=not grammar)
        llm.add_request(None, [1, 2, 3, 4, 5, 6, 7, 8], p)
    times = []
    while llm.core.has_unfinished_requests():
        t0 = time.perf_counter()
        llm.step()
        dt = time.perf_counter() - t0
        if len(llm.core.scheduler.running) == batch and all(
            r.num_output_tokens >= 2 for r in llm.core.scheduler.running
        ):
            times.append(dt)
    return times[:steps]


def mask_cost(llm: LLM, batch: int, reps: int = 50) -> tuple[float, float]:
    """Milliseconds per step to fill the batch's bitmask and to apply it to [batch, vocab] logits."""
    so: StructuredOutputs = llm.core.structured
    states = [so.submit(StructuredOutputsParams(json=LONG)).result() for _ in range(batch)]
    logits = torch.randn(batch, llm.core.vocab_size)
    t0 = time.perf_counter()
    for _ in range(reps):
        bitmask, rows = so.fill_bitmask(states)
    fill = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        apply_token_bitmask(logits, bitmask, rows)
    return fill * 1e3, (time.perf_counter() - t0) / reps * 1e3


def compile_times(llm: LLM) -> tuple[float, float, float]:
    from tests.engine.test_structured_outputs import SCHEMAS

    fresh = StructuredOutputs(llm.core.model_config.path, llm.core.vocab_size, llm.core.model_config.eos_token_ids)
    t0 = time.perf_counter()
    fresh.tokenizer_info()
    vocab_s = time.perf_counter() - t0
    cold = [_timed(fresh, s) for s in SCHEMAS]
    warm = [_timed(fresh, s) for s in SCHEMAS]
    return vocab_s, statistics.median(cold) * 1e3, statistics.median(warm) * 1e3, max(cold) * 1e3


def _timed(so: StructuredOutputs, schema) -> float:
    t0 = time.perf_counter()
    so.compile(StructuredOutputsParams(json=json.dumps(schema)))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=0, help="a trained tokenizer of this size (0: the bundled model)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", default="/tmp/fulcrum-bench")
    args = ap.parse_args()
    folder = (
        big_vocab_model(args.vocab, Path(args.work_dir) / f"shakespeare-vocab{args.vocab}") if args.vocab else BUNDLED
    )
    llm = LLM(str(folder), max_num_seqs=64, dtype="float32")
    print(cpu_summary())
    print(f"model {folder.name}: vocabulary {llm.core.vocab_size}")
    step_times(llm, 2, True, 4)  # warm-up: kernels, the vocabulary read, the schema compiled
    rows = []
    for batch in (1, 32):
        free, constrained = [], []
        for _ in range(args.repeats):  # in turn, so that a slow minute of the VM hits both
            free.append(statistics.median(step_times(llm, batch, False, args.steps)) * 1e3)
            constrained.append(statistics.median(step_times(llm, batch, True, args.steps)) * 1e3)
        fill, apply = mask_cost(llm, batch)
        f, c = statistics.median(free), statistics.median(constrained)
        rows.append(
            (
                batch,
                f"{f:.2f} ({min(free):.2f}-{max(free):.2f})",
                f"{c:.2f} ({min(constrained):.2f}-{max(constrained):.2f})",
                f"{(c / f - 1) * 100:+.1f}%",
                f"{fill:.3f}",
                f"{apply:.3f}",
            )
        )
    print_table(
        "decode step, ms (median of repeats; range)",
        rows,
        ("batch", "no grammar", "JSON schema", "cost", "mask fill ms", "mask apply ms"),
    )
    vocab_s, cold, warm, worst = compile_times(llm)
    print(
        f"compile: vocabulary read {vocab_s:.2f} s once per engine; 36 schemas: median {cold:.1f} ms cold "
        f"(slowest {worst:.1f} ms), {warm:.3f} ms from the cache"
    )


if __name__ == "__main__":
    main()
