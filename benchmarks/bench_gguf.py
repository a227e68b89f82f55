"""GGUF files run by fulcrum and by llama.cpp in turn, on the same files, in one script.

    python benchmarks/bench_gguf.py [--formats BF16,Q8_0,Q4_0,Q4_K_M] [--npl 8,16,32] [--reps 3] [--out FILE]

llama.cpp's own tools are built from the llama-cpp-python sdist (benchmarks/llama_cpp.py, once). The files: the
Qwen2.5-0.5B shape (random weights; speed) and the bundled model (trained on Shakespeare; perplexity), each written
as BF16 by the gguf package (the test suite's writer, as llama.cpp's converter writes one) and quantized from it by
`llama-quantize`, as a user makes them. Where a 0.5B row is not a whole number of 256-value super-blocks (896 inputs),
llama-quantize falls back from K-quants to Q5_0/Q8_0 for that tensor, as it does on the real model.

Per file:
- batch-1 decode (`llama-bench` tg128: 128 tokens from an empty context) against fulcrum's engine generating 128
  tokens after a 1-token prompt (the time of 129 tokens less the time of 1);
- prompt processing (`llama-bench` pp512) against fulcrum prefilling 512 tokens (generating one);
- batched (`llama-batched-bench`, npl sequences of 128 prompt tokens and 128 generated each) against fulcrum
  generating the same, greedy, ignoring EOS: total tokens / total time, and generated tokens / decode time;
- bandwidth roofline at batch 1: the bytes each engine reads per token (llama.cpp: the file's tensors; fulcrum: the
  weights it holds, fulcrum.quant.gguf's layouts) over the best read bandwidth measured so far in the run (a sum
  over 1 GiB, before the first file and after each);
- perplexity on the held-out Shakespeare with llama-perplexity's method (chunks of 512, second halves scored):
  `llama-perplexity` against `fulcrum eval FILE --chunks`, and fulcrum's KL divergence from the BF16 file.
Both engines get both cores (-t 2; fulcrum's torch threads). Reps: llama-bench's own -r; fulcrum's median of --reps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import llama_cpp  # noqa: E402
from benchmarks.common import BUNDLED, cpu_summary, memory_bandwidth_gbs, qwen05_model, save_json  # noqa: E402

THREADS = 2


def gguf_files(folder: Path, arch: str, out: Path, formats: list[str]) -> dict[str, Path]:
    """BF16 written by the gguf package, the others by llama-quantize from it."""
    from gguf import GGMLQuantizationType as Q

    from tests.models.test_gguf import write_gguf

    out.mkdir(parents=True, exist_ok=True)
    files = {"BF16": out / "model-BF16.gguf"}
    if not files["BF16"].exists():
        write_gguf(folder, files["BF16"], arch, Q.BF16)
    for fmt in formats:
        if fmt == "BF16":
            continue
        files[fmt] = out / f"model-{fmt}.gguf"
        if not files[fmt].exists():
            subprocess.run([llama_cpp.tool("llama-quantize"), files["BF16"], files[fmt], fmt, str(THREADS)],
                           check=True, capture_output=True)  # fmt: skip
    return {f: files[f] for f in formats}


def llama_bench(file: Path, reps: int) -> dict:
    res = subprocess.run([llama_cpp.tool("llama-bench"), "-m", file, "-p", "512", "-n", "128", "-t", str(THREADS),
                          "-r", str(reps), "-o", "json"], check=True, capture_output=True, text=True)  # fmt: skip
    out = {}
    for row in json.loads(res.stdout):
        key = "pp512" if row["n_prompt"] else "tg128"
        out[key] = {"tok_s": row["avg_ts"], "stddev": row["stddev_ts"]}
        out["model_bytes"] = row["model_size"]
    return out


def llama_batched(file: Path, npl: list[int]) -> dict:
    ctx = max(npl) * 256 + 256
    res = subprocess.run([llama_cpp.tool("llama-batched-bench"), "-m", file, "-c", str(ctx), "-b", "2048", "-ub",
                          "512", "-npp", "128", "-ntg", "128", "-npl", ",".join(map(str, npl)), "-t", str(THREADS),
                          "--output-format", "jsonl"], check=True, capture_output=True, text=True)  # fmt: skip
    out = {}
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[row["pl"]] = {"total_tok_s": row["speed"], "decode_tok_s": row["speed_tg"], "seconds": row["t"]}
    return out


def llama_perplexity(file: Path, text: Path) -> float:
    res = subprocess.run([llama_cpp.tool("llama-perplexity"), "-m", file, "-f", text, "-c", "512", "-b", "512",
                          "-t", str(THREADS)], capture_output=True, text=True)  # fmt: skip
    log = res.stdout + res.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    if m:
        return float(m.group(1))
    # its logger thread may drop the last line when the output is a pipe: the running estimate after the last
    # chunk is the same figure
    chunks = re.findall(r"\[(\d+)\]([0-9.]+),", log)
    if res.returncode or not chunks:
        raise RuntimeError(f"llama-perplexity on {file}: {log[-1500:]}")
    return float(chunks[-1][1])


def _timed(llm, prompts, max_tokens: int) -> float:
    from fulcrum import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t0


def fulcrum_speed(file: Path, npl: list[int], reps: int) -> dict:
    import random

    from fulcrum import LLM

    rng = random.Random(0)
    llm = LLM(model=str(file), enable_prefix_caching=False, max_num_seqs=max(npl), seed=0,
              kv_cache_memory=512 << 20)  # fmt: skip
    vocab = llm.core.model_config.hf_config.vocab_size
    ids = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    _timed(llm, [ids(16)], 8)  # warm-up: kernels built, pages touched
    out = {"weight_bytes": llm.core.runner.weight_bytes, "weights": llm.core.runner.weights_format}
    pp = [512 / _timed(llm, [ids(512)], 1) for _ in range(reps)]
    tg = []
    for _ in range(reps):
        p = ids(1)
        one, full = _timed(llm, [p], 1), _timed(llm, [p], 129)
        tg.append(128 / (full - one))
    out["pp512"] = {"tok_s": statistics.median(pp), "spread": [min(pp), max(pp)]}
    out["tg128"] = {"tok_s": statistics.median(tg), "spread": [min(tg), max(tg)]}
    out["batched"] = {}
    for n in npl:
        prompts = [ids(128) for _ in range(n)]
        prefill = _timed(llm, prompts, 1)
        total = _timed(llm, [ids(128) for _ in range(n)], 128)
        out["batched"][n] = {"total_tok_s": n * 256 / total, "decode_tok_s": n * 127 / max(total - prefill, 1e-9),
                             "seconds": total}  # fmt: skip
    llm.close()
    return out


def fulcrum_perplexity(file: Path, text: str, reference: Path | None) -> dict:
    from fulcrum.eval.perplexity import RunSpec, evaluate

    ref = RunSpec(str(reference)) if reference is not None and reference != file else None
    r = evaluate(RunSpec(str(file)), text, ref, context=512, chunks=True)
    return {"perplexity": r.perplexity, "tokens_scored": r.tokens_scored, "kl_mean": r.kl_mean, "kl_p99": r.kl_p99,
            "top1_agreement": r.top1_agreement}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="BF16,Q8_0,Q4_0,Q4_K_M")
    p.add_argument("--npl", default="8,16,32", help="sequences side by side in the batched runs")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--work-dir", default=os.environ.get("FULCRUM_BENCH_DIR", "/tmp/fulcrum-bench"))
    p.add_argument("--skip", default="", help="parts to leave out: speed, perplexity")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    formats, npl, skip = a.formats.split(","), [int(n) for n in a.npl.split(",")], set(a.skip.split(","))
    llama_cpp.ensure()
    work = Path(a.work_dir)
    torch_threads = os.environ.get("OMP_NUM_THREADS")
    result = {"machine": cpu_summary(), "llama.cpp": llama_cpp.version(), "threads": THREADS,
              "omp_num_threads": torch_threads, "formats": formats}  # fmt: skip
    print(result["machine"], "|", result["llama.cpp"], flush=True)
    bw = memory_bandwidth_gbs()
    result["read_bandwidth_gbs"] = bw
    print(f"read bandwidth {bw:.1f} GB/s", flush=True)

    if "speed" not in skip:
        files = gguf_files(qwen05_model(work / "qwen2.5-0.5b-shape"), "qwen2", work / "gguf-qwen05", formats)
        result["speed"] = {}
        for fmt, file in files.items():
            lc = llama_bench(file, a.reps)
            lc["batched"] = llama_batched(file, npl)
            fc = fulcrum_speed(file, npl, a.reps)
            # this VM's bandwidth drifts (35-60 GB/s within an hour here): the best reading so far is the roofline
            bw = result["read_bandwidth_gbs"] = max(bw, memory_bandwidth_gbs())
            for side, bytes_ in (("llama.cpp", lc["model_bytes"]), ("fulcrum", fc["weight_bytes"])):
                r = lc if side == "llama.cpp" else fc
                r["tg128"]["roofline_tok_s"] = bw * 1e9 / bytes_
                r["tg128"]["of_roofline"] = r["tg128"]["tok_s"] / r["tg128"]["roofline_tok_s"]
            result["speed"][fmt] = {"llama.cpp": lc, "fulcrum": fc}
            print(f"\n{fmt}: fulcrum holds {fc['weight_bytes'] / 2**20:.0f} MiB ({fc['weights']}), "
                  f"llama.cpp {lc['model_bytes'] / 2**20:.0f} MiB", flush=True)  # fmt: skip
            for key in ("tg128", "pp512"):
                f_, l_ = fc[key]["tok_s"], lc[key]["tok_s"]
                extra = ""
                if key == "tg128":
                    extra = (f" | of roofline: fulcrum {fc[key]['of_roofline']:.0%}, "
                             f"llama.cpp {lc[key]['of_roofline']:.0%}")  # fmt: skip
                print(f"  {key}: fulcrum {f_:.1f} tok/s (spread {fc[key]['spread'][0]:.1f}-{fc[key]['spread'][1]:.1f})"
                      f" vs llama.cpp {l_:.1f} +/- {lc[key]['stddev']:.1f}: {f_ / l_:.2f}x{extra}", flush=True)  # fmt: skip
            for n in npl:
                f_, l_ = fc["batched"][n], lc["batched"].get(n)
                if l_:
                    print(f"  batched {n}x(128+128): fulcrum {f_['total_tok_s']:.1f} tok/s vs llama.cpp "
                          f"{l_['total_tok_s']:.1f}: {f_['total_tok_s'] / l_['total_tok_s']:.2f}x (decode "
                          f"{f_['decode_tok_s']:.1f} vs {l_['decode_tok_s']:.1f})", flush=True)  # fmt: skip
            save_json(a.out, result)

    if "perplexity" not in skip:
        from fulcrum.eval.perplexity import DEFAULT_DATA, held_out_text

        files = gguf_files(BUNDLED, "llama", work / "gguf-bundled", formats)
        text = held_out_text(DEFAULT_DATA)
        text_file = work / "held-out.txt"
        text_file.write_text(text, encoding="utf-8")
        result["perplexity"] = {}
        for fmt, file in files.items():
            lc = llama_perplexity(file, text_file)
            fc = fulcrum_perplexity(file, text, files.get("BF16"))
            result["perplexity"][fmt] = {"llama.cpp": lc, "fulcrum": fc}
            kl = f", KL from BF16 mean {fc['kl_mean']:.5f} p99 {fc['kl_p99']:.4f}" if fc["kl_mean"] is not None else ""
            print(f"perplexity {fmt}: fulcrum {fc['perplexity']:.4f} vs llama.cpp {lc:.4f} "
                  f"({fc['perplexity'] / lc - 1:+.2%}){kl}", flush=True)  # fmt: skip
            save_json(a.out, result)


if __name__ == "__main__":
    main()
