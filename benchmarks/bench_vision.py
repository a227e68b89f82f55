"""Image-request time to first token on a tiny Qwen2.5-VL (random weights, transformers' own classes, the test
suite's model: tests/tiny_vision.py), split into its parts, in one process:

- preprocess: the frontend's image processor and the prompt's image tokens expanded (engine/multimodal.py
  ImagePrompts);
- encode: the vision tower on the engine's device for an image it has not seen (ImageEncoder, its cache missed);
- TTFT, new image: `LLM.generate` with max_tokens=1 of a prompt with an image never sent before (preprocess +
  encode + prefill + one sample);
- TTFT, seen image: the same prompt and image again, the prefix cache off, so only the embedding cache saves work
  (preprocess + prefill + one sample); prefill is this less preprocess.

Medians (and min/max) over --repeats fresh images. The machine may be shared: the figures are indicative.

    python benchmarks/bench_vision.py [--repeats 20] [--side 112] [--out benchmarks/results/vision/bench-vision.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cpu_summary, print_table, save_json  # noqa: E402
from fulcrum.engine.llm import LLM  # noqa: E402
from fulcrum.sampling_params import SamplingParams  # noqa: E402
from tests.tiny_vision import png, save_tiny_vision_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "vision"
PROMPT = "describe <|vision_start|><|image_pad|><|vision_end|> in a few words, please"


def stats(xs: list[float]) -> dict:
    return {"median_ms": statistics.median(xs) * 1e3, "min_ms": min(xs) * 1e3, "max_ms": max(xs) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--side", type=int, default=112, help="image side in pixels (the tiny processor caps 112 x 112)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench-vision.json")
    args = p.parse_args()
    print(cpu_summary())
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_vision_model("qwen2_5-vl", Path(tmp) / "m")
        llm = LLM(str(folder), dtype="float32")
        fresh = LLM(str(folder), dtype="float32", enable_prefix_caching=False)
        one = SamplingParams(temperature=0.0, max_tokens=1)
        ids0 = llm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        for lm in (llm, fresh):  # warm-up: the processor and the tower are built at the first image
            lm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": [png(10**6, (args.side,) * 2)]}}], one,
                        use_tqdm=False)  # fmt: skip
        parts: dict[str, list[float]] = {k: [] for k in ("preprocess", "encode", "ttft_new", "ttft_seen", "prefill")}
        image_tokens = 0
        for i in range(args.repeats):
            image = png(i, (args.side,) * 2)
            t = time.perf_counter()
            ids, image_input = llm._image_prompter(ids0, [image], "bench")
            parts["preprocess"].append(time.perf_counter() - t)
            image_tokens = ids.count(llm.core.model_config.multimodal_config.image_token_id)
            t = time.perf_counter()
            llm.core.runner.prepare_images(ids, image_input)  # a new image: the tower runs
            parts["encode"].append(time.perf_counter() - t)
            request = {"prompt": PROMPT, "multi_modal_data": {"image": [png(10_000 + i, (args.side,) * 2)]}}
            t = time.perf_counter()
            fresh.generate([request], one, use_tqdm=False)
            parts["ttft_new"].append(time.perf_counter() - t)
            t = time.perf_counter()
            fresh.generate([request], one, use_tqdm=False)  # its embeddings cached, its KV blocks not (no prefix cache)
            parts["ttft_seen"].append(time.perf_counter() - t)
            parts["prefill"].append(parts["ttft_seen"][-1] - parts["preprocess"][-1])
        encodes = fresh.core.runner.image_encoder.encodes
        llm.close()
        fresh.close()
    result = {
        "machine": cpu_summary(),
        "note": "a shared machine (other work running): indicative figures, not precise ones",
        "model": "tiny Qwen2.5-VL (tests/tiny_vision.py): 2 text layers of 64, a 1-block vision tower of 32",
        "image_side_px": args.side,
        "prompt_tokens": len(ids),
        "image_tokens": image_tokens,
        "repeats": args.repeats,
        "encodes_in_ttft_engine": encodes,
        **{k: stats(v) for k, v in parts.items()},
    }
    rows = [(k, f"{v['median_ms']:.2f}", f"{v['min_ms']:.2f}", f"{v['max_ms']:.2f}")
            for k, v in result.items() if isinstance(v, dict)]  # fmt: skip
    print_table("image request TTFT parts (ms)", rows, ("part", "median", "min", "max"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_json(args.out, result)


if __name__ == "__main__":
    main()
