"""The Triton kernels one by one on a CUDA device, each against what it replaced, measured in the same run:

    python benchmarks/bench_triton_kernels.py [--out results.json] [--budget-s 80] [--dry-run]

Every case is timed with triton.testing.do_bench (median, L2 flushed before each call) and reported as its time, the
bytes it must move, the effective GB/s and that rate's share of the device-to-device copy bandwidth measured at the
start (2 GiB copied, bytes read + written per second):

1. paged decode attention, bf16 cache, block size 16, random block tables (the blocks of all rows shuffled), every
   row at the full context: Qwen2.5-0.5B's heads (14 q, 2 KV, 64) and a Llama-8B-like shape (32, 8, 128) at batch
   1/16/64 and contexts 512/4096/32768 (cases over --max-kv-gb of KV skipped). Bytes: K and V read once, q, out,
   block table. Baseline: fulcrum's first PyTorch path (gather k_cache[block_tables] into a padded [B, KVH, L, D]
   copy, masked F.scaled_dot_product_attention), both as Attention._decode ran it in 16 bits (a KV head's query
   heads as its query rows) and with enable_gqa; the ratio is against the faster of the two;
2. paged prefill (varlen, one sequence): a fresh 2048-token prompt and a 512-token chunk on 4096 cached tokens,
   against F.scaled_dot_product_attention on contiguous q/k/v (K/V expanded to every query head; causal, lower-right
   for the chunk); TFLOP/s from 4 * heads * D * q_len * (cached + q_len / 2);
3. rope_and_cache (rotary on q and k in place, k and v written to a bf16 cache at random slots) for 1/64/4096 tokens
   against apply_rotary + index_copy_; rms_norm with the residual add for 1/64/4096 rows at hidden 896 and 4096
   against the PyTorch expressions (x + h, then RMSNorm's fp32 normalize);
4. paged decode again with int8 and fp8 caches (fp16 scales per token and KV head, quantized from the same bf16
   values), against the bf16 kernel of part 1 (last, as the most compilations: it is what --budget-s cuts first).

Ratios are the baseline's time over the kernel's (above 1: the kernel is faster); each case also checks the kernel's
output against its baseline's (max abs error, printed). Kernels are compiled on their first call, outside the timing;
cases that would start after --budget-s seconds are skipped and listed. --dry-run runs every case once on tiny
shapes (on CPU through Triton's interpreter): no timing, no figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fulcrum.kernels.triton  # noqa: E402,F401  (first: sets TRITON_INTERPRET on a machine without CUDA)
from fulcrum.kernels.triton import decode_attention, prefill_attention, rms_norm, rope_cache  # noqa: E402
from fulcrum.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from fulcrum.quant import kv as kv_quant  # noqa: E402

SHAPES = {"qwen05": (14, 2, 64), "llama8b": (32, 8, 128)}  # heads, KV heads, head dim
NORM_HIDDEN = {"qwen05": 896, "llama8b": 4096}
BLOCK = 16
DTYPE = torch.bfloat16
BF16 = 2


class Runner:
    """Times (or, in a dry run, just calls) each case, and skips what starts after the time budget."""

    def __init__(self, dry: bool, budget_s: float, warmup_ms: int, rep_ms: int):
        self.dry, self.budget_s, self.warmup_ms, self.rep_ms = dry, budget_s, warmup_ms, rep_ms
        self.t0 = time.perf_counter()
        self.skipped: list[str] = []
        self.copy_gbs = float("nan")

    def over_budget(self, name: str) -> bool:
        if not self.dry and time.perf_counter() - self.t0 > self.budget_s:
            self.skipped.append(name)
            print(f"{name}: skipped (past the {self.budget_s:.0f} s budget)", flush=True)
            return True
        return False

    def time_ms(self, fn) -> float | None:
        fn()  # compiles on the first call, outside the timing
        if self.dry:
            return None
        import triton.testing

        r = triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, quantiles=[0.5])
        return float(r[0] if isinstance(r, (list, tuple)) else r)

    def against_torch(self, name: str, kernel, baseline, nbytes: int, **labels) -> dict:
        """Time the kernel and the PyTorch it replaces, print the line, return the row (`labels` first)."""
        ms, base_ms = self.time_ms(kernel), self.time_ms(baseline)
        row = {**labels, **self.rate(nbytes, ms), "torch_ms": base_ms, "speedup_vs_torch": ratio(base_ms, ms)}
        tb = "-" if base_ms is None else f"{base_ms * 1e3:.1f} us"
        print(f"{name:40s} {fmt_rate(row)}; torch {tb}: {fmt_x(row['speedup_vs_torch'])}", flush=True)
        return row

    def rate(self, nbytes: int, ms: float | None) -> dict:
        """Effective GB/s of `nbytes` in `ms` and its share of the copy bandwidth."""
        if ms is None:
            return {"ms": None, "bytes": nbytes}
        gbs = nbytes / ms / 1e6
        return {"ms": ms, "bytes": nbytes, "gbs": gbs, "copy_share": gbs / self.copy_gbs}


def fmt_rate(r: dict) -> str:
    if r["ms"] is None:
        return f"{r['bytes'] / 1e6:.2f} MB"
    return f"{r['ms'] * 1e3:8.1f} us, {r['bytes'] / 1e6:8.2f} MB, {r['gbs']:6.0f} GB/s ({r['copy_share']:4.0%} of copy)"


def ratio(baseline_ms: float | None, ms: float | None) -> float | None:
    return None if baseline_ms is None or ms is None else baseline_ms / ms


def fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def copy_bandwidth_gbs(gib: float = 2.0, repeats: int = 5) -> float:
    """Device-to-device copy, bytes read plus written per second (best of `repeats`, CUDA events)."""
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    del x, y
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / best / 1e6


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ---- decode


def decode_case(shape: str, batch: int, ctx: int, device, seed: int = 0) -> dict:
    """q [B, H, D], bf16 caches of exactly the rows' blocks, shuffled: every row's blocks are scattered."""
    heads, kvh, d = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(seed)
    nblk = -(-ctx // BLOCK)
    num_blocks = batch * nblk
    k = torch.randn(num_blocks, BLOCK, kvh, d, generator=g, device=device, dtype=DTYPE)
    v = torch.randn(num_blocks, BLOCK, kvh, d, generator=g, device=device, dtype=DTYPE)
    q = torch.randn(batch, heads, d, generator=g, device=device, dtype=DTYPE)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    bt = perm.view(batch, nblk).to(torch.int32).to(device)
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    pos = torch.arange(nblk * BLOCK, device=device)
    mask = (pos[None, :] < ctx_lens[:, None].long())[:, None, None, :]  # shared by a step's layers: built once
    # the PyTorch path indexes with int64 block ids (int32 index tensors are not accepted by every torch)
    return dict(
        q=q, k=k, v=v, bt=bt, bt_long=bt.long(), ctx_lens=ctx_lens, mask=mask, scale=d**-0.5, heads=heads, kvh=kvh, d=d
    )


def decode_bytes(batch: int, ctx: int, heads: int, kvh: int, d: int, elem: int, scaled: bool) -> int:
    kv = 2 * batch * ctx * kvh * (d * elem + (2 if scaled else 0))  # K and V, with an fp16 scale per token and head
    return kv + 2 * batch * heads * d * BF16 + batch * -(-ctx // BLOCK) * 4  # + q, out, block table


def torch_decode(c: dict, k, v, ks=None, vs=None, gqa: bool = False) -> torch.Tensor:
    """Attention._decode's PyTorch path: the rows' blocks gathered into a padded copy (dequantized where the cache
    is), then masked SDPA; `gqa` False groups a KV head's query heads as its query rows (as it ran in 16 bits)."""
    q, bt = c["q"], c["bt_long"]
    b, heads, d = q.shape
    kvh = c["kvh"]
    kg = k[bt] if ks is None else kv_quant.dequantize(k[bt], ks[bt], q.dtype)
    vg = v[bt] if vs is None else kv_quant.dequantize(v[bt], vs[bt], q.dtype)
    kg = kg.flatten(1, 2).transpose(1, 2)  # [B, KVH, L, D]
    vg = vg.flatten(1, 2).transpose(1, 2)
    if gqa:
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kg, vg, attn_mask=c["mask"], scale=c["scale"], enable_gqa=True
        )
        return o.squeeze(2)
    qg = q.view(b, kvh, heads // kvh, d)
    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=c["mask"], scale=c["scale"])
    return o.reshape(b, heads, d)


def triton_decode(c: dict, k, v, ks=None, vs=None) -> torch.Tensor:
    return decode_attention.paged_decode(c["q"], k, v, c["bt"], c["ctx_lens"], c["scale"], k_scales=ks, v_scales=vs)


def default_splits(c: dict, device) -> int | None:
    try:  # as paged_decode picks them for a group of up to 16 query heads per KV head
        return decode_attention.default_num_splits(
            c["q"].shape[0], c["kvh"] * -(-(c["heads"] // c["kvh"]) // 16), c["bt"].shape[1] * BLOCK, device
        )
    except Exception:  # a figure for the report only
        return None


def bench_decode(run: Runner, shapes, batches, contexts, max_kv_bytes: float, device) -> list[dict]:
    rows = []
    for shape in shapes:
        heads, kvh, d = SHAPES[shape]
        for batch in batches:
            for ctx in contexts:
                name = f"decode {shape} bf16 B={batch} ctx={ctx}"
                kv_bytes = 2 * batch * ctx * kvh * d * BF16
                if kv_bytes > max_kv_bytes:
                    print(f"{name}: skipped ({kv_bytes / 1e9:.1f} GB of KV)", flush=True)
                    continue
                if run.over_budget(name):
                    continue
                c = decode_case(shape, batch, ctx, device)
                k, v = c["k"], c["v"]
                out = triton_decode(c, k, v)
                ms = run.time_ms(lambda c=c, k=k, v=v: triton_decode(c, k, v))
                row = {"shape": shape, "batch": batch, "ctx": ctx, "splits": default_splits(c, device)}
                row.update(run.rate(decode_bytes(batch, ctx, heads, kvh, d, BF16, False), ms))
                ref = torch_decode(c, k, v)
                row["max_err_vs_torch"] = max_err(out, ref)
                row["torch_grouped_ms"] = run.time_ms(lambda c=c, k=k, v=v: torch_decode(c, k, v))
                try:
                    row["torch_enable_gqa_ms"] = run.time_ms(lambda c=c, k=k, v=v: torch_decode(c, k, v, gqa=True))
                except (RuntimeError, TypeError) as e:  # enable_gqa needs torch >= 2.5
                    row["torch_enable_gqa_ms"] = None
                    print(f"  enable_gqa baseline failed: {e}", flush=True)
                base = [t for t in (row["torch_grouped_ms"], row["torch_enable_gqa_ms"]) if t is not None]
                row["speedup_vs_torch"] = ratio(min(base) if base else None, ms)
                rows.append(row)
                tq = "/".join("-" if t is None else f"{t * 1e3:.0f}" for t in (row["torch_grouped_ms"],
                              row["torch_enable_gqa_ms"]))  # fmt: skip
                print(f"{name:40s} {fmt_rate(row)}; torch {tq} us (grouped/enable_gqa): "
                      f"{fmt_x(row['speedup_vs_torch'])}  [splits {row['splits']}, err {row['max_err_vs_torch']:.1e}]",
                      flush=True)  # fmt: skip
                del c, k, v, out, ref
    return rows


def bench_decode_quant(run: Runner, shapes, batches, contexts, max_kv_bytes, kv_dtypes, bf16_rows, device):
    """The same cases with int8/fp8 caches quantized from the same bf16 values; against the bf16 kernel's time."""
    bf16_ms = {(r["shape"], r["batch"], r["ctx"]): r["ms"] for r in bf16_rows}
    rows = []
    for shape in shapes:
        heads, kvh, d = SHAPES[shape]
        for batch in batches:
            for ctx in contexts:
                if 2 * batch * ctx * kvh * d * BF16 > max_kv_bytes:
                    continue
                names = [f"decode {shape} {kv} B={batch} ctx={ctx}" for kv in kv_dtypes]
                if any(run.over_budget(n) for n in names):
                    continue
                c = decode_case(shape, batch, ctx, device)
                ref = triton_decode(c, c["k"], c["v"]).clone()
                for kv, name in zip(kv_dtypes, names):
                    fmt = kv_quant.FORMATS[kv]
                    kq, ks = kv_quant.quantize(c["k"], fmt)
                    vq, vs = kv_quant.quantize(c["v"], fmt)
                    out = triton_decode(c, kq, vq, ks, vs)
                    ms = run.time_ms(lambda c=c, kq=kq, vq=vq, ks=ks, vs=vs: triton_decode(c, kq, vq, ks, vs))
                    row = {"shape": shape, "kv": kv, "batch": batch, "ctx": ctx}
                    row.update(run.rate(decode_bytes(batch, ctx, heads, kvh, d, 1, True), ms))
                    row["max_err_vs_bf16"] = max_err(out, ref)
                    row["bf16_ms"] = bf16_ms.get((shape, batch, ctx))
                    row["speedup_vs_bf16"] = ratio(row["bf16_ms"], ms)
                    rows.append(row)
                    print(f"{name:40s} {fmt_rate(row)}; vs bf16 kernel {fmt_x(row['speedup_vs_bf16'])}  "
                          f"[err vs bf16 {row['max_err_vs_bf16']:.1e}]", flush=True)  # fmt: skip
                    del kq, vq, ks, vs, out
                del c, ref
    return rows


# ---- prefill


def bench_prefill(run: Runner, shapes, cases, device) -> list[dict]:
    """One sequence of q_len new tokens after `past` cached ones, all in a shuffled paged cache, against SDPA on the
    same values laid out contiguously."""
    rows = []
    for shape in shapes:
        heads, kvh, d = SHAPES[shape]
        group = heads // kvh
        for label, q_len, past in cases:
            name = f"prefill {shape} {label}"
            if run.over_budget(name):
                continue
            ctx = past + q_len
            nblk = -(-ctx // BLOCK)
            g = torch.Generator(device=device).manual_seed(1)
            kc = torch.randn(nblk, BLOCK, kvh, d, generator=g, device=device, dtype=DTYPE)
            vc = torch.randn(nblk, BLOCK, kvh, d, generator=g, device=device, dtype=DTYPE)
            q = torch.randn(q_len, heads, d, generator=g, device=device, dtype=DTYPE)
            bt = torch.randperm(nblk, generator=torch.Generator().manual_seed(1)).to(torch.int32).to(device)[None]
            meta = [torch.tensor([x], dtype=torch.int32, device=device) for x in (0, q_len, ctx)]
            scale = d**-0.5
            out = torch.empty_like(q)

            def kernel(q=q, kc=kc, vc=vc, bt=bt, meta=meta, q_len=q_len, scale=scale, out=out):
                return prefill_attention.paged_prefill(q, kc, vc, *meta, bt, scale, q_len, out=out)

            # the same keys and values in order, expanded to every query head: [1, H, L, D]
            k_lin = kc[bt[0].long()].flatten(0, 1)[:ctx]
            v_lin = vc[bt[0].long()].flatten(0, 1)[:ctx]
            kt = k_lin.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0).contiguous()
            vt = v_lin.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0).contiguous()
            qt = q.transpose(0, 1).unsqueeze(0).contiguous()
            if past == 0:
                sdpa_kw = {"is_causal": True}
            else:
                try:
                    from torch.nn.attention.bias import causal_lower_right

                    sdpa_kw = {"attn_mask": causal_lower_right(q_len, ctx)}
                except ImportError:
                    qpos = torch.arange(past, ctx, device=device)[:, None]
                    sdpa_kw = {"attn_mask": torch.arange(ctx, device=device)[None, :] <= qpos}

            def baseline(qt=qt, kt=kt, vt=vt, kw=sdpa_kw, scale=scale):
                return F.scaled_dot_product_attention(qt, kt, vt, scale=scale, **kw)

            err = max_err(kernel(), baseline().squeeze(0).transpose(0, 1))
            ms, base_ms = run.time_ms(kernel), run.time_ms(baseline)
            flops = 4 * heads * d * q_len * (past + q_len / 2)
            row = {"shape": shape, "case": label, "q_len": q_len, "cached": past, "flops": flops, "ms": ms,
                   "sdpa_ms": base_ms, "max_err_vs_sdpa": err, "speedup_vs_sdpa": ratio(base_ms, ms)}  # fmt: skip
            if ms is not None:
                row["tflops"], row["sdpa_tflops"] = flops / ms / 1e9, flops / base_ms / 1e9
                print(f"{name:40s} {ms * 1e3:8.1f} us, {row['tflops']:6.1f} TFLOP/s; SDPA {base_ms * 1e3:.1f} us, "
                      f"{row['sdpa_tflops']:.1f} TFLOP/s: {fmt_x(row['speedup_vs_sdpa'])}  [err {err:.1e}]",
                      flush=True)  # fmt: skip
            else:
                print(f"{name:40s} ran  [err vs SDPA {err:.1e}]", flush=True)
            rows.append(row)
            del kc, vc, q, out, kt, vt, qt
    return rows


# ---- rope + cache write, rms_norm


def bench_rope(run: Runner, shapes, tokens, device) -> list[dict]:
    rows = []
    for shape in shapes:
        heads, kvh, d = SHAPES[shape]
        for t in tokens:
            name = f"rope_and_cache {shape} T={t}"
            if run.over_budget(name):
                continue
            g = torch.Generator(device=device).manual_seed(2)
            qkv = torch.randn(t, (heads + 2 * kvh) * d, generator=g, device=device, dtype=DTYPE)
            q = qkv[:, : heads * d].view(t, heads, d)
            k = qkv[:, heads * d : (heads + kvh) * d].view(t, kvh, d)
            v = qkv[:, (heads + kvh) * d :].view(t, kvh, d)
            positions = torch.randint(0, 4096, (t,), generator=g, device=device)
            cos, sin = RotaryEmbedding(d, 4096, {"rope_type": "default", "rope_theta": 1e6}).to(device)(
                positions, DTYPE
            )
            num_blocks = 4 * -(-t // BLOCK) + 4
            kc = torch.zeros(num_blocks, BLOCK, kvh, d, device=device, dtype=DTYPE)
            vc = torch.zeros_like(kc)
            slots = torch.randperm(num_blocks * BLOCK, generator=torch.Generator().manual_seed(2))[:t].to(device)

            def kernel(q=q, k=k, v=v, cos=cos, sin=sin, slots=slots, kc=kc, vc=vc):
                rope_cache.rope_and_cache(q, k, v, cos, sin, slots, kc, vc)

            def baseline(q=q, k=k, v=v, cos=cos, sin=sin, slots=slots, kc=kc, vc=vc, kvh=kvh, d=d):
                q2, k2 = apply_rotary(q, k, cos, sin)
                kc.view(-1, kvh, d).index_copy_(0, slots, k2)
                vc.view(-1, kvh, d).index_copy_(0, slots, v)
                return q2

            # read q, k, v, cos, sin and the slots; write q, k and the cache's k, v
            nbytes = t * (
                (heads + 2 * kvh) * d * BF16 + 2 * d * BF16 + 8 + (heads + kvh) * d * BF16 + 2 * kvh * d * BF16
            )
            rows.append(run.against_torch(name, kernel, baseline, nbytes, shape=shape, tokens=t))
    return rows


def bench_norm(run: Runner, hiddens, rows_list, device, eps: float = 1e-6) -> list[dict]:
    rows = []
    for hidden in hiddens:
        for t in rows_list:
            name = f"rms_norm+residual hidden={hidden} T={t}"
            if run.over_budget(name):
                continue
            g = torch.Generator(device=device).manual_seed(3)
            h = torch.randn(t, hidden, generator=g, device=device, dtype=DTYPE)
            res = torch.randn(t, hidden, generator=g, device=device, dtype=DTYPE)
            w = (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(DTYPE)

            def kernel(h=h, res=res, w=w):
                return rms_norm.rms_norm(h, w, eps, residual=res)  # res += h in place

            def baseline(h=h, res=res, w=w):  # the decoder layer's `x = x + h`, then RMSNorm.forward's expression
                x = res + h
                xf = x.float()
                xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                return w * xf.to(x.dtype), x

            nbytes = 4 * t * hidden * BF16 + hidden * BF16  # read h, residual; write residual, out; the weight
            rows.append(run.against_torch(name, kernel, baseline, nbytes, hidden=hidden, rows=t))
    return rows


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the figures as JSON")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"attention shapes, of {', '.join(SHAPES)}")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--contexts", default="512,4096,32768")
    p.add_argument("--kv-dtypes", default="int8,fp8", help="quantized caches for part 4 ('' for none)")
    p.add_argument("--max-kv-gb", type=float, default=8.0, help="skip decode cases with more bf16 KV than this")
    p.add_argument("--tokens", default="1,64,4096", help="rope_and_cache tokens and rms_norm rows")
    p.add_argument("--budget-s", type=float, default=80.0, help="skip the cases that would start after this")
    p.add_argument("--warmup-ms", type=int, default=10)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--dry-run", action="store_true", help="every case once on tiny shapes (CPU: interpreted)")
    args = p.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    kv_dtypes = [s for s in args.kv_dtypes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    for s in kv_dtypes:
        if s not in kv_quant.FORMATS:
            p.error(f"unknown KV dtype {s!r}; known: {', '.join(kv_quant.FORMATS)}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        sys.exit("bench_triton_kernels.py measures a CUDA device (--dry-run runs the cases once on CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    run = Runner(args.dry_run, args.budget_s, args.warmup_ms, args.rep_ms)
    if args.dry_run:  # tiny shapes: a context that ends inside a block, a chunk on cached tokens
        batches, contexts, tokens = [2], [40], [1, 5]
        prefill_cases = [("fresh 24", 24, 0), ("chunk 8 on 20", 8, 20)]
    else:
        batches, contexts, tokens = ints(args.batches), ints(args.contexts), ints(args.tokens)
        prefill_cases = [("fresh 2048", 2048, 0), ("chunk 512 on 4096", 512, 4096)]
    max_kv = args.max_kv_gb * 1e9

    import triton

    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreted)", "torch": torch.__version__,
                 "triton": triton.__version__, "dry_run": args.dry_run}  # fmt: skip
    if cuda and not args.dry_run:
        run.copy_gbs = res["copy_bandwidth_gbs"] = copy_bandwidth_gbs()
    if args.dry_run:
        what = "dry run: tiny shapes, one call each, no timing"
    else:
        what = f"copy bandwidth {run.copy_gbs:.0f} GB/s (read + written); ratios: baseline time / kernel time"
    print(f"{res['device']}, torch {torch.__version__}, triton {triton.__version__}; {what}", flush=True)

    res["decode"] = bench_decode(run, shapes, batches, contexts, max_kv, device)
    res["prefill"] = bench_prefill(run, shapes, prefill_cases, device)
    res["rope_cache"] = bench_rope(run, shapes, tokens, device)
    res["rms_norm"] = bench_norm(run, sorted({NORM_HIDDEN[s] for s in shapes}), tokens, device)
    res["decode_quant"] = bench_decode_quant(run, shapes, batches, contexts, max_kv, kv_dtypes, res["decode"], device)
    res["skipped"] = run.skipped
    res["seconds"] = time.perf_counter() - run.t0
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.dry_run:
        print(f"dry run ok ({res['seconds']:.0f} s)", flush=True)
    else:
        print(f"done in {res['seconds']:.0f} s; skipped {len(run.skipped)}", flush=True)


if __name__ == "__main__":
    main()
