"""Incremental detokenization: DecodeStream (tokenizers, for a fast tokenizer) against the window decode
(two `tokenizer.decode` calls per token, what a tokenizer without a Rust backend gets).

    python benchmarks/bench_detokenizer.py [--model bundled|PATH] [--tokens 2000]

Streams the same tokens one by one through both, as the frontend does for one request (a text delta
taken after every token), checks that both give the same text, and prints the time per token.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import BUNDLED, REPO, print_table, save_json  # noqa: E402
from fulcrum.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from fulcrum.utils.tokenizer import load_tokenizer  # noqa: E402

CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


class WindowOnly:
    """The tokenizer seen without its Rust backend: the detokenizer falls back to the window decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, *args, **kw):
        return self.tokenizer.decode(*args, **kw)


def stream(tokenizer, prompt: list[int], ids: list[int], stop: list[str] | None) -> str:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    text = []
    for t in ids:
        hit = detok.add_tokens([t])
        text.append(detok.take_delta(finished=hit is not None))
        if hit:
            break
    detok.flush()
    text.append(detok.take_delta(finished=True))
    return "".join(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled", help="bundled, or a folder with a tokenizer")
    p.add_argument("--tokens", type=int, default=2000, help="tokens streamed per run")
    p.add_argument("--text", default=str(CORPUS), help="text to tokenize (default: the tiny-shakespeare corpus)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each; the fastest counts")
    p.add_argument("--out", default=None, help="write the figures as JSON")
    args = p.parse_args()

    tok = load_tokenizer(BUNDLED if args.model == "bundled" else args.model)
    text = Path(args.text).read_text() if Path(args.text).exists() else (REPO / "README.md").read_text()
    ids = []
    while len(ids) < args.tokens + 100:
        ids += tok(text[: 20 * args.tokens], verbose=False)["input_ids"]
    prompt, gen = ids[:100], ids[100 : 100 + args.tokens]

    rows, figures = [], {}
    for label, stop in [("no stop string", None), ("one stop string", ["\n\n\n\n"])]:
        best = {}
        texts = {}
        for _ in range(args.repeats):
            for name, tokenizer in [("window decode", WindowOnly(tok)), ("DecodeStream", tok)]:
                t0 = time.perf_counter()
                texts[name] = stream(tokenizer, prompt, gen, stop)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
        assert texts["window decode"] == texts["DecodeStream"], "the two decoders disagree"
        base, new = best["window decode"], best["DecodeStream"]
        rows.append((label, f"{base / len(gen) * 1e6:.1f}", f"{new / len(gen) * 1e6:.1f}", f"{base / new:.1f}x"))
        figures[label] = {
            "window_us_per_token": base / len(gen) * 1e6,
            "decode_stream_us_per_token": new / len(gen) * 1e6,
        }
    print_table(
        f"{len(gen)} tokens streamed one by one ({args.model} tokenizer)",
        rows,
        ("", "window decode us/token", "DecodeStream us/token", "speed-up"),
    )
    save_json(args.out, figures)


if __name__ == "__main__":
    main()
