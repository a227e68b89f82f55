"""`fulcrum <verb>`: the one entry point."""

from __future__ import annotations

import argparse
import sys
import time

from fulcrum.config import DEFAULT_MODEL


def _generate(args: argparse.Namespace) -> int:
    import torch

    from fulcrum.config import ModelConfig
    from fulcrum.engine.reference import generate_ids
    from fulcrum.models.loader import load_model
    from fulcrum.utils.tokenizer import load_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig.from_path(args.model, dtype=args.dtype)
    model = load_model(cfg, device=device)
    tok = load_tokenizer(cfg.path)
    prompt_ids = tok(args.prompt)["input_ids"]
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    ids: list[int] = []
    shown = ""
    t0 = time.perf_counter()
    for t in generate_ids(
        model, prompt_ids, args.max_tokens, cfg.eos_token_ids, args.temperature, args.top_k, args.seed
    ):
        if t in cfg.eos_token_ids:
            break
        ids.append(t)
        text = tok.decode(ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # hold back a half-decoded multi-byte character
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    dt = time.perf_counter() - t0
    out.write("\n")
    print(f"[{len(ids)} tokens in {dt:.2f} s, {len(ids) / max(dt, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fulcrum", description="LLM inference engine and inference-engineering toolkit")
    sub = p.add_subparsers(dest="verb", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    g.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder (default: the bundled model)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.set_defaults(func=_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
