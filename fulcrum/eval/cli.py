"""`fulcrum eval`: perplexity of a configuration on a text, and its KL divergence from a reference run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fulcrum.defaults import DEFAULT_MODEL, INT4_GROUP_SIZES, KV_CACHE_DTYPES, QUANTIZATIONS


def add_eval_parser(sub) -> argparse.ArgumentParser:
    e = sub.add_parser(
        "eval",
        help="perplexity on a text, and KL divergence / top-1 agreement against the unquantized model",
        description="Perplexity of a model (any --quantization) on a text file in sliding windows; with a "
        "reference run (default: the same model unquantized, when --quantization is given) also the mean and "
        "99th-percentile KL divergence of the next-token distributions, top-1 agreement and the perplexity ratio. "
        "Default data: the held-out last 10%% of ../shared/data/tinyshakespeare.txt (the bundled model's).",
    )
    e.add_argument("model_pos", nargs="?", metavar="MODEL", help="model folder (default: the bundled model)")
    e.add_argument("--model", default=str(DEFAULT_MODEL))
    e.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 (auto: the checkpoint's)")
    e.add_argument("--quantization", choices=QUANTIZATIONS, default=None)
    e.add_argument("--quantization-group-size", type=int, choices=INT4_GROUP_SIZES, default=128)
    e.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
        help="the run's KV cache (fp8, int8: quantized); scored through the decode path",
    )  # fmt: skip
    e.add_argument(
        "--decode", action="store_true",
        help="score through the decode path: one token per step, attention over a paged KV cache, as a server runs",
    )  # fmt: skip
    e.add_argument("--data", default=None, help="a UTF-8 text file, scored whole (default: the held-out Shakespeare)")
    e.add_argument("--context", type=int, default=256, help="tokens per window")
    e.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: context / 2)")
    e.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    e.add_argument(
        "--chunks", action="store_true",
        help="llama-perplexity's method: whole chunks of --context tokens, each scoring its second half (figures "
        "comparable with llama.cpp's on the same file)",
    )  # fmt: skip
    r = e.add_argument_group("reference run")
    r.add_argument("--reference-model", default=None, help="default: the model itself")
    r.add_argument("--reference-dtype", default=None, help="default: --dtype")
    r.add_argument("--reference-quantization", choices=QUANTIZATIONS, default=None, help="default: none")
    r.add_argument("--no-reference", action="store_true", help="perplexity only")
    e.add_argument("--json", action="store_true", help="print the figures as JSON")
    e.set_defaults(func=run_eval)
    return e


def _prequantized(model: str) -> bool:
    """Whether the folder's config.json carries a quantization_config (GPTQ, AWQ, compressed-tensors), or the GGUF
    file holds blocks (Q8_0, Q4_K ...)."""
    if model.endswith(".gguf"):
        from fulcrum.config import ModelConfig

        try:
            return ModelConfig.from_path(model).quantization == "gguf"
        except Exception:  # noqa: BLE001 (loading reports it)
            return False
    try:
        return bool(json.loads((Path(model) / "config.json").read_text()).get("quantization_config"))
    except (OSError, ValueError):
        return False


def run_eval(args: argparse.Namespace) -> int:
    from fulcrum.errors import FulcrumError
    from fulcrum.eval.perplexity import DEFAULT_DATA, RunSpec, evaluate, format_result, held_out_text

    model = args.model_pos or args.model
    run = RunSpec(model, args.dtype, args.quantization, args.quantization_group_size, args.kv_cache_dtype)
    want_ref = not args.no_reference and (
        args.quantization
        or args.kv_cache_dtype != "auto"
        or args.reference_model
        or args.reference_dtype
        or args.reference_quantization
    )
    reference = None
    if args.quantization and _prequantized(model):  # the loader's own refusal, before any reference is asked for
        from fulcrum.config import ModelConfig

        try:
            ModelConfig.from_path(model, quantization=args.quantization)
        except (FulcrumError, ValueError, OSError) as e:  # a one-line error, as any bad flag
            print(f"fulcrum eval: {e}", file=sys.stderr)
            return 2
    if want_ref and not args.reference_model and _prequantized(model):
        print(
            f"fulcrum eval: {model} is a quantized checkpoint, so the same folder cannot be its unquantized "
            "reference: give the full-precision model with --reference-model (or --no-reference)",
            file=sys.stderr,
        )
        return 2
    if want_ref:
        reference = RunSpec(
            args.reference_model or model,
            args.reference_dtype or args.dtype,
            args.reference_quantization,
            args.quantization_group_size,
        )
    try:
        text = Path(args.data).read_text(encoding="utf-8") if args.data else held_out_text(DEFAULT_DATA)
        result = evaluate(
            run, text, reference, args.context, args.stride, args.max_windows, args.decode, chunks=args.chunks
        )
    except (OSError, ValueError, FulcrumError) as e:  # a bad file or model: one line, as a bad flag
        print(f"fulcrum eval: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=2) if args.json else format_result(result))
    return 0
