"""`fulcrum plan --validate`: predict the engine's prefill and decode speed on this machine from the model's
config and measured hardware figures, then run the engine and put the two side by side. The measuring is
`fulcrum.probe`'s, passed in by the CLI: `measure_machine` returns `LocalMeasurements`, `measure_engine` the
engine's speed as a dict."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from fulcrum.plan.local import LOCAL_EFFICIENCY, LocalMeasurements, local_hardware
from fulcrum.plan.model_spec import load_model_spec
from fulcrum.plan.roofline import decode_step, prefill, step_overhead


@dataclass
class Comparison:
    quantity: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def validate(
    model: str,
    measure_machine: Callable[..., LocalMeasurements],
    measure_engine: Callable[..., dict],
    input_len: int = 512,
    output_len: int = 64,
    batch_sizes: tuple[int, ...] = (1,),
    decode_prompt_len: int = 32,
    console: Console | None = None,
) -> dict:
    c = console or Console()
    spec = load_model_spec(model)
    dtype = spec.dtype
    c.print(f"[bold]validate[/bold] {spec.name} ({dtype}) on this machine: predicting from config.json ...")
    context = decode_prompt_len + output_len // 2  # the mean KV length over the measured decode
    measured = measure_machine(spec, dtype, matmul_tokens=input_len, batch_sizes=batch_sizes, decode_context=context)
    hw = local_hardware(measured)
    pred_prefill = prefill(spec, hw, dtype, input_len, eff=LOCAL_EFFICIENCY)
    pred_decode = {b: decode_step(spec, hw, dtype, dtype, b, context, eff=LOCAL_EFFICIENCY) for b in batch_sizes}
    for note in hw.notes:
        c.print("  " + note)
    over = step_overhead(spec, hw)
    c.print(
        f"  per-step framework overhead predicted: {over * 1e3:.2f} ms (a timed decoder layer x layers + the step's other ops)"
    )

    c.print("running fulcrum's engine ...")
    got = measure_engine(
        model=model,
        device="cpu",
        input_len=input_len,
        output_len=output_len,
        batch_sizes=tuple(batch_sizes),
        decode_prompt_len=decode_prompt_len,
    )
    rows = [
        Comparison(f"prefill {input_len} tokens (tokens/s)", pred_prefill.tokens_per_s, got["prefill_tokens_per_s"])
    ]
    for b, p in pred_decode.items():
        m = got["decode"][b]
        rows.append(Comparison(f"decode batch {b}: TPOT (ms)", p.tpot_s * 1e3, m["tpot_s"] * 1e3))
        rows.append(Comparison(f"decode batch {b}: tokens/s", p.tokens_per_s, m["tokens_per_s"]))

    t = Table(title=f"{spec.name}: predicted (roofline + overhead) against measured (engine)")
    for col in ("quantity", "predicted", "measured", "error"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r.quantity, f"{r.predicted:,.2f}", f"{r.measured:,.2f}", f"{r.error:+.0%}")
    c.print(t)
    d1 = pred_decode[batch_sizes[0]]
    c.print(
        f"decode batch {batch_sizes[0]} predicted: {d1.bytes_per_step / 1e6:,.1f} MB read per step at "
        f"{hw.bandwidth / 1e9:.1f} GB/s = {d1.bytes_per_step / hw.bandwidth * 1e3:.2f} ms, plus {over * 1e3:.2f} ms "
        f"overhead; engine weights {got['weight_bytes'] / 1e6:,.1f} MB, {got['threads']} threads"
    )
    return {
        "model": spec.name,
        "dtype": dtype,
        "hardware": {
            "bandwidth_gbs_by_batch": {b: v / 1e9 for b, v in hw.bandwidth_by_batch.items()},
            "flops": hw.flops,
            "op_latency_us": hw.op_latency_s * 1e6,
        },
        "comparisons": [{**r.__dict__, "error": r.error} for r in rows],
        "measured": got,
    }
