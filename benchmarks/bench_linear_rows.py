"""A decode step's bf16 linears at few rows, cold weights: oneDNN's prepacked matmul (AMX tiles where the CPU has
them; what fulcrum packs bf16 weights for at the amx level; widened to fp32 below AVX-512 BF16) against fulcrum's
blocked kernel (csrc/blocked_linear.cpp: AVX-512 BF16 dot products at avx512_bf16, bf16 widened in registers below)
and, up to its rows, fulcrum's GEMV (csrc/gemv.cpp), on Qwen2.5-0.5B's shapes (random weights).

    .venv/bin/python benchmarks/bench_linear_rows.py [--rows 5,8,12] [--out F.json]

Each shape's weights are copied until the copies pass --cycle-mb, and each call takes the next copy, so that every
call reads its weight from memory as a decode step does (the LM head, 272 MB, is one copy cycled with a second).
Per shape and row count: the second-best of three passes of each kernel, in turn, as ms a call and GB/s of weight.
Needs fulcrum's kernels at avx2 or above. Nothing else may run beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import QWEN05_SHAPE, cpu_summary, save_json  # noqa: E402
from fulcrum.kernels import cpu_gemv, cpu_prepack  # noqa: E402


def shapes() -> dict[str, tuple[int, int]]:
    s = QWEN05_SHAPE
    hd = s["hidden_size"] // s["num_attention_heads"]
    qkv = s["hidden_size"] + 2 * s["num_key_value_heads"] * hd
    return {"qkv": (qkv, s["hidden_size"]), "o": (s["hidden_size"], s["hidden_size"]),
            "gate_up": (2 * s["intermediate_size"], s["hidden_size"]),
            "down": (s["hidden_size"], s["intermediate_size"]), "lm_head": (s["vocab_size"], s["hidden_size"])}  # fmt: skip


def time_shape(blocked, name: str, out_f: int, in_f: int, rows: list[int], cycle_mb: int) -> list[dict]:
    """The kernels on one shape at each row count, over copies of the weight that pass cycle_mb."""
    n = max(2, cycle_mb * 10**6 // (out_f * in_f * 2))
    plain = [torch.randn(out_f, in_f).to(torch.bfloat16) for _ in range(n)]
    dt = cpu_prepack._onednn_dtype(torch.bfloat16)  # fp32 where torch has no native bf16 matmul
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w.to(dt), cpu_prepack.PACKED_FOR_ROWS) for w in plain]
    tiles = [cpu_prepack.block(w) for w in plain]
    gemv_rows = cpu_gemv.MAX_ROWS[cpu_gemv.level()].get(torch.bfloat16, 0)
    res = []
    for m in rows:
        x = torch.randn(m, in_f).to(torch.bfloat16)
        y = torch.empty(m, out_f, dtype=torch.bfloat16)

        def call(kind: str, i: int, x=x, y=y, m=m) -> None:
            if kind == "onednn":  # with its input's and output's conversions where it computes in fp32
                torch.ops.mkldnn._linear_pointwise(x.to(dt), onednn[i], None, "none", [], "").to(torch.bfloat16)
            elif kind == "gemv":
                cpu_gemv.gemv(x, plain[i])
            else:
                blocked(1, x.data_ptr(), tiles[i].data_ptr(), None, y.data_ptr(), m, in_f, out_f)

        times = {"onednn": [], "blocked": [], **({"gemv": []} if m <= gemv_rows else {})}
        for _ in range(3):
            for kind in times:
                t = time.perf_counter()
                for i in range(n):
                    call(kind, i)
                times[kind].append((time.perf_counter() - t) / n)
        got = {k: sorted(v)[1] for k, v in times.items()}
        gbs = {k: out_f * in_f * 2 / s / 1e9 for k, s in got.items()}
        gemv = f", GEMV {got['gemv'] * 1e3:8.3f} ms ({gbs['gemv']:5.1f})" if "gemv" in got else ""
        print(f"{name:8s} rows {m:2d}: oneDNN {got['onednn'] * 1e3:8.3f} ms ({gbs['onednn']:5.1f} GB/s), blocked "
              f"{got['blocked'] * 1e3:8.3f} ms ({gbs['blocked']:5.1f}){gemv}: blocked / oneDNN "
              f"{got['blocked'] / got['onednn']:.2f}", flush=True)  # fmt: skip
        res.append({"shape": name, "out": out_f, "in": in_f, "rows": m, "copies": n, "seconds": times})
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="5,8,12")
    p.add_argument("--cycle-mb", type=int, default=600)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    blocked = cpu_prepack._blocked()
    if blocked is None or not cpu_prepack.blocked_dtype(torch.bfloat16):
        sys.exit(f"needs fulcrum's blocked kernel for bf16 (kernels here: {cpu_gemv.level()})")
    print(cpu_summary())
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    res = []
    for name, (out_f, in_f) in shapes().items():
        res += time_shape(blocked, name, out_f, in_f, rows, args.cycle_mb)
    save_json(Path(args.out) if args.out else None, {"cpu": cpu_summary(), "results": res})


if __name__ == "__main__":
    main()
