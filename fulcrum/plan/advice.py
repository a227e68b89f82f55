"""What to do, in the order of operations: make the weights fit (quantize, split, a larger card), then make room
for the KV cache the requested concurrency needs (KV quantization, a shorter context, more GPUs)."""

from __future__ import annotations

from fulcrum.plan.catalog import Hardware
from fulcrum.plan.memory import MemoryPlan, plan_memory
from fulcrum.plan.model_spec import DTYPE_BYTES, ModelSpec

# weight formats from the most to the least precise; int8/int4 run weight-only (dequantized into 16-bit matmuls)
# on any GPU, fp8 and fp4 need the format in the tensor cores
QUANT_ORDER = ("fp8", "int8", "int4", "fp4")


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def spec_bytes(m: MemoryPlan, bytes_per_param: float) -> float:
    return m.params.total * bytes_per_param


def runnable(hw: Hardware, dtype: str) -> bool:
    return dtype in ("int8", "int4") or dtype in hw.formats


def _replan(spec: ModelSpec, hw: Hardware, m: MemoryPlan, **change) -> MemoryPlan:
    kw = dict(
        weight_dtype=m.weight_dtype, kv_dtype=m.kv_dtype, context=m.context, concurrency=m.concurrency, tp=m.tp, pp=m.pp
    )
    return plan_memory(spec, hw, **{**kw, **change})


def weight_levers(spec: ModelSpec, hw: Hardware, m: MemoryPlan, catalog: dict[str, Hardware]) -> list[str]:
    sizes, fit = [], None
    for d in QUANT_ORDER:
        if DTYPE_BYTES[d] < DTYPE_BYTES[m.weight_dtype] and runnable(hw, d) and DTYPE_BYTES[d] not in sizes:
            q = _replan(spec, hw, m, weight_dtype=d, tp=1, pp=1)
            sizes.append(DTYPE_BYTES[d])
            if q.weights_fit and q.max_concurrency >= 1:
                fit = (d, q)
                break
    tried = ", ".join(f"{b * 8:g}-bit {gb(spec_bytes(m, b))}" for b in sizes)
    if fit:
        d, q = fit
        out = [
            f"quantize the weights ({tried}): {d} fits on one {hw.name} with room for "
            f"{q.max_concurrency} sequence(s) of {m.context} tokens"
        ]
    else:
        out = [f"quantize the weights ({tried}): not even that fits the model on one {hw.name}"]
    if m.min_gpus:
        split = f"TP={m.suggested_tp}" + (f" x PP={m.suggested_pp}" if m.suggested_pp > 1 else "")
        per = _replan(spec, hw, m, tp=m.suggested_tp, pp=m.suggested_pp)
        out.append(
            f"split the model: {split} over {m.min_gpus} x {hw.name}, {gb(per.weights_per_gpu)} of weights per GPU, "
            f"room for {per.max_concurrency} sequence(s) of {m.context} tokens"
        )
    else:
        out.append(f"more than 64 x {hw.name} would be needed at {m.weight_dtype}")
    larger = [
        h.name
        for h in catalog.values()
        if h.memory_bytes > hw.memory_bytes and _replan(spec, h, m, tp=1, pp=1).max_concurrency >= 1
    ]
    out.append(
        f"a larger card: {', '.join(larger)} hold(s) it at {m.weight_dtype}"
        if larger
        else f"a larger card: none in the catalog holds it alone at {m.weight_dtype}"
    )
    return out


def kv_levers(spec: ModelSpec, hw: Hardware, m: MemoryPlan) -> list[str]:
    out = []
    if DTYPE_BYTES[m.kv_dtype] > 1:
        q = _replan(spec, hw, m, kv_dtype="fp8")
        out.append(f"quantize the KV cache to fp8: {q.max_concurrency} sequences of {m.context} tokens fit")
    half = _replan(spec, hw, m, context=max(1, m.context // 2))
    out.append(f"a shorter context, {half.context} tokens: {half.max_concurrency} sequences fit")
    if DTYPE_BYTES[m.weight_dtype] > 1 and runnable(hw, "fp8"):
        w = _replan(spec, hw, m, weight_dtype="fp8")
        out.append(f"fp8 weights leave room for {w.max_concurrency} sequences")
    if m.tp * 2 <= 8:
        wider = _replan(spec, hw, m, tp=m.tp * 2)
        out.append(f"TP={wider.tp}: {wider.max_concurrency} sequences fit")
    return out


def what_to_do(spec: ModelSpec, hw: Hardware, m: MemoryPlan, catalog: dict[str, Hardware]) -> list[str]:
    where = f"{m.num_gpus} x {hw.name}" if m.num_gpus > 1 else f"one {hw.name}"
    if not m.weights_fit:
        head = (
            f"The weights ({gb(m.weight_bytes)} at {m.weight_dtype}) do not fit on {where} "
            f"({gb(m.capacity)}, {gb(m.usable)} usable per GPU). Levers:"
        )
        return [head, *weight_levers(spec, hw, m, catalog)]
    if m.max_concurrency < 1:
        head = f"The weights fit on {where}, but not one {m.context}-token sequence's KV cache beside them. Levers:"
        return [head, *kv_levers(spec, hw, m)]
    if m.max_concurrency < m.concurrency:
        head = (
            f"The weights fit on {where}; the KV cache limits concurrency to {m.max_concurrency} sequences "
            f"of {m.context} tokens ({m.concurrency} asked). Levers:"
        )
        return [head, *kv_levers(spec, hw, m)]
    return [
        f"Fits on {where}: {m.concurrency} sequences of {m.context} tokens need {gb(m.kv_total)} of KV cache; "
        f"up to {m.max_concurrency} fit."
    ]
