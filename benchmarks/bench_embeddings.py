"""Embeddings per second: fulcrum (`LLM.embed`, and `/v1/embeddings` through `fulcrum serve`) against
sentence-transformers (`SentenceTransformer.encode`, the library an embedding model's card points at) on the same
model and the same texts, in the same script.

The model: Qwen2.5-0.5B's shape with random weights, saved as Qwen3-Embedding is laid out (the bare backbone, a
last-token Pooling module, Normalize) by sentence-transformers itself. The texts: --num-texts seeded random word
strings of --min-len to --max-len tokens. Each engine runs in a process of its own (its threads on every core of
this machine, nothing else running), alternating, --repeats times; reported per engine: texts/s and tokens/s
(min/median/max over the repeats), and the ratio of the medians. The vectors are compared too (worst cosine between
fulcrum's and sentence-transformers').

    python benchmarks/bench_embeddings.py [--dtype bfloat16|float32] [--num-texts 64] [--batch-size 32] \\
        [--repeats 3] [--out benchmarks/results/embeddings/bench-embeddings-bf16.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import QWEN05_SHAPE, cpu_summary, print_table, save_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "embeddings"
_SENTENCE = "the model serves every request in one batch of tokens while the cache keeps what each prompt has computed"
WORDS = _SENTENCE.split(" ")


def build_model(folder: Path, dtype: str) -> Path:
    """Save (once) the 0.5B-shape embedding model in sentence-transformers' layout."""
    if (folder / "modules.json").exists():
        return folder
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling, Transformer
    from transformers import AutoModel, Qwen2Config

    from benchmarks.common import BUNDLED
    from fulcrum.utils.tokenizer import copy_tokenizer

    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN05_SHAPE)
    backbone = folder.parent / f"{folder.name}-backbone"
    AutoModel.from_config(cfg, dtype=getattr(torch, dtype)).save_pretrained(backbone)
    copy_tokenizer(BUNDLED, backbone)
    (backbone / "chat_template.jinja").unlink(missing_ok=True)  # sentence-transformers 6 would wrap texts in it
    modules = [Transformer(str(backbone)), Pooling(cfg.hidden_size, "lasttoken"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def texts(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


# -- one engine's run, in a process of its own -----------------------------------------------------------------------


def run_one(engine: str, folder: str, dtype: str, texts_file: str, batch_size: int, out_file: str) -> None:
    import torch

    items = json.loads(Path(texts_file).read_text())
    if engine == "fulcrum":
        from fulcrum.engine.llm import LLM

        llm = LLM(folder, dtype=dtype)
        llm.embed(items[:4], use_tqdm=False)  # warm-up
        tokens = sum(len(llm.tokenizer(t)["input_ids"]) for t in items)
        t0 = time.perf_counter()
        vecs = [o.outputs.embedding for o in llm.embed(items, use_tqdm=False)]
        elapsed = time.perf_counter() - t0
        llm.close()
    elif engine == "served":
        import httpx

        from fulcrum.utils.serve_process import start

        with start(folder, "--dtype", dtype, "--log-level", "warning") as server:
            url = server.url + "/v1/embeddings"
            httpx.post(url, json={"input": items[:4]}, timeout=600)  # warm-up
            t0 = time.perf_counter()
            body = httpx.post(url, json={"input": items}, timeout=3600).json()
            elapsed = time.perf_counter() - t0
        vecs = [d["embedding"] for d in body["data"]]
        tokens = body["usage"]["prompt_tokens"]
    else:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(folder, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
        model.encode(items[:4], batch_size=batch_size)  # warm-up
        tokens = sum(len(model.tokenizer(t)["input_ids"]) for t in items)
        t0 = time.perf_counter()
        vecs = model.encode(items, batch_size=batch_size, convert_to_numpy=True).astype(np.float32).tolist()
        elapsed = time.perf_counter() - t0
    Path(out_file).write_text(json.dumps({"seconds": elapsed, "tokens": tokens, "vectors": vecs}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--num-texts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", default="sentence-transformers,fulcrum,served")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "fulcrum-bench"))
    p.add_argument("--out", default=None)
    p.add_argument("--one", nargs=6, help=argparse.SUPPRESS)  # engine folder dtype texts batch out: one child run
    args = p.parse_args()
    if args.one:
        e, folder, dtype, tf, bs, out = args.one
        run_one(e, folder, dtype, tf, int(bs), out)
        return
    print(cpu_summary())
    folder = build_model(Path(args.work_dir) / f"qwen2.5-0.5b-shape-embed-{args.dtype}", args.dtype)
    work = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    tf = work / "texts.json"
    tf.write_text(json.dumps(texts(args.num_texts, args.min_len, args.max_len)))
    engines = args.engines.split(",")
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for r in range(args.repeats):
        for e in engines:
            out = work / f"{e}-{r}.json"
            cmd = [
                sys.executable,
                __file__,
                "--one",
                e,
                str(folder),
                args.dtype,
                str(tf),
                str(args.batch_size),
                str(out),
            ]
            subprocess.run(cmd, check=True)
            res = json.loads(out.read_text())
            runs[e].append(res)
            print(f"  {e} run {r + 1}: {res['seconds']:.2f} s, {args.num_texts / res['seconds']:.2f} texts/s")
    ref = np.array(runs[engines[0]][0]["vectors"])
    summary = {}
    for e in engines:
        secs = [x["seconds"] for x in runs[e]]
        vec = np.array(runs[e][0]["vectors"])
        cos = (vec * ref).sum(1) / np.linalg.norm(vec, axis=1) / np.linalg.norm(ref, axis=1)
        summary[e] = {
            "texts_per_s": [args.num_texts / s for s in sorted(secs, reverse=True)],
            "tokens_per_s_median": runs[e][0]["tokens"] / statistics.median(secs),
            "seconds": secs,
            "tokens": runs[e][0]["tokens"],
            f"worst_cosine_vs_{engines[0]}": float(cos.min()),
        }
    base = statistics.median(summary[engines[0]]["texts_per_s"])
    rows = []
    for e, s in summary.items():
        tps = s["texts_per_s"]
        s["ratio_vs_" + engines[0]] = statistics.median(tps) / base
        rows.append((e, f"{tps[0]:.2f}/{statistics.median(tps):.2f}/{tps[-1]:.2f}", f"{s['tokens_per_s_median']:.0f}",
                     f"{s['ratio_vs_' + engines[0]]:.2f}x", f"{s[f'worst_cosine_vs_{engines[0]}']:.6f}"))  # fmt: skip
    print_table(
        f"embeddings, 0.5B shape, {args.dtype}, {args.num_texts} texts of {args.min_len}-{args.max_len} words",
        rows, ("engine", "texts/s min/med/max", "tokens/s", "vs " + engines[0], "worst cosine"),
    )  # fmt: skip
    save_json(args.out, {"cpu": cpu_summary(), "args": {k: v for k, v in vars(args).items() if k != "one"},
                         "results": summary})  # fmt: skip


if __name__ == "__main__":
    main()
