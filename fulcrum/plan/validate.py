"""`fulcrum plan --validate`: predict the engine's prefill and decode speed on this machine from the model's
config and measured hardware figures, then run the engine and put the two side by side, with the weight bytes the
engine holds against the predicted ones. An online quantization (`--quantization int8|int4|fp8`) and a KV-cache
dtype (`--kv-cache-dtype fp8|int8`) go to both sides. The measuring is `fulcrum.probe`'s, passed in by the CLI:
`measure_machine` returns `LocalMeasurements`, `measure_engine` the engine's speed as a dict."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fulcrum.errors import ModelLoadError
from fulcrum.plan.local import LOCAL_EFFICIENCY, LocalMeasurements, local_hardware
from fulcrum.plan.model_spec import ModelSpec, kv_bytes_per_token_layer, load_model_spec
from fulcrum.plan.roofline import OnlineQuant, decode_step, prefill, resident_weight_bytes, step_overhead

# the engine's --kv-cache-dtype values in plan's names ("auto" is the model's own dtype)
KV_CACHE_DTYPES = {"fp8": "fp8", "fp8_e4m3": "fp8", "int8": "int8"}


@dataclass
class Comparison:
    quantity: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def checkpoint_quantization(model: str) -> str | None:
    """The quant_method of a model folder's config.json quantization_config, if it has one."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    stated = cfg.get("quantization_config") or cfg.get("text_config", {}).get("quantization_config")
    return str(stated.get("quant_method", "unknown")).lower() if stated else None


def weight_format(spec: ModelSpec, model: str, quantization: str | None, group_size: int) -> OnlineQuant | None:
    """What the weights will be on both sides, refusing what the engine would refuse (or plan cannot predict)
    before anything is measured."""
    if not Path(model, "config.json").is_file():
        raise ModelLoadError(f"--validate runs fulcrum's engine on a model folder; {model!r} is not one")
    stored = checkpoint_quantization(model)
    if stored and quantization:
        raise ModelLoadError(
            f"{spec.name} is already quantized ({stored}): --quantization {quantization} quantizes a "
            "full-precision checkpoint online; drop it"
        )
    if stored:
        raise ModelLoadError(
            f"{spec.name} is a {stored} checkpoint: plan --validate predicts full-precision checkpoints, quantized "
            "online or not (--quantization int8|int4|fp8)"
        )
    if quantization is None:
        return None
    quant = OnlineQuant(quantization, group_size)
    quant.check(spec)
    return quant


def validate(
    model: str,
    measure_machine: Callable[..., LocalMeasurements],
    measure_engine: Callable[..., dict],
    input_len: int = 512,
    output_len: int = 64,
    batch_sizes: tuple[int, ...] = (1,),
    decode_prompt_len: int = 32,
    quantization: str | None = None,
    group_size: int = 128,
    kv_cache_dtype: str = "auto",
    console: Console | None = None,
) -> dict:
    c = console or Console()
    spec = load_model_spec(model)
    dtype = spec.dtype
    quant = weight_format(spec, model, quantization, group_size)
    kv_dtype = KV_CACHE_DTYPES.get(kv_cache_dtype, dtype)
    weights = quant.describe() if quant else dtype
    predicted_weights = resident_weight_bytes(spec, dtype, quant)
    kv_head = kv_bytes_per_token_layer(spec, kv_dtype) / (2 * spec.num_kv_heads)
    kv_text = kv_dtype + (" + an fp16 scale per token and KV head" if kv_dtype != dtype else "")
    c.print(f"[bold]validate[/bold] {spec.name} ({dtype}) on this machine: predicting from config.json ...")
    c.print(f"  weights: {weights}" + (f"; norms and biases {dtype}" if quant else ""))
    if quant:
        table = "tied embedding: the quantized LM head's table" if spec.tied else f"untied embedding stays {dtype}"
        c.print(f"  quantized: every linear layer and the LM head; {table}")
    c.print(f"  KV cache: {kv_text} ({kv_head:g} bytes per head of {spec.head_dim})")
    context = decode_prompt_len + output_len // 2  # the mean KV length over the measured decode
    measured = measure_machine(
        spec,
        dtype,
        matmul_tokens=input_len,
        batch_sizes=batch_sizes,
        decode_context=context,
        quant=quant,
        kv_cache_dtype=kv_cache_dtype,
    )
    hw = local_hardware(measured)
    pred_prefill = prefill(spec, hw, dtype, input_len, eff=LOCAL_EFFICIENCY, quant=quant)
    pred_decode = {
        b: decode_step(spec, hw, dtype, kv_dtype, b, context, eff=LOCAL_EFFICIENCY, quant=quant) for b in batch_sizes
    }
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
        quantization=quantization,
        quantization_group_size=group_size,
        kv_cache_dtype=kv_cache_dtype,
    )
    rows = [
        Comparison(f"prefill {input_len} tokens (tokens/s)", pred_prefill.tokens_per_s, got["prefill_tokens_per_s"])
    ]
    for b, p in pred_decode.items():
        m = got["decode"][b]
        rows.append(Comparison(f"decode batch {b}: TPOT (ms)", p.tpot_s * 1e3, m["tpot_s"] * 1e3))
        rows.append(Comparison(f"decode batch {b}: tokens/s", p.tokens_per_s, m["tokens_per_s"]))
    rows.append(Comparison("resident weights (MB)", predicted_weights / 1e6, got["weight_bytes"] / 1e6))

    c.print(f"predicted for: weights {quant.name if quant else dtype}, KV cache {kv_dtype}")
    layers = f", {got['quantized_layers']} layers quantized" if quantization else ""
    c.print(f"measured with: weights {got['quantization']}{layers}, KV cache {got['kv_cache_dtype']}")
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
        f"overhead; engine weights {got['weight_bytes'] / 1e6:,.2f} MB "
        f"({got['engine_weight_bytes'] / 1e6:,.2f} MB with the RoPE tables), {got['threads']} threads"
    )
    return {
        "model": spec.name,
        "dtype": dtype,
        "quantization": {"method": quant.method, "group_size": quant.group_size} if quant else None,
        "kv_cache_dtype": kv_dtype,
        "predicted_weight_bytes": predicted_weights,
        "hardware": {
            "bandwidth_gbs_by_batch": {b: v / 1e9 for b, v in hw.bandwidth_by_batch.items()},
            "flops": hw.flops,
            "op_latency_us": hw.op_latency_s * 1e6,
        },
        "comparisons": [{**r.__dict__, "error": r.error} for r in rows],
        "measured": got,
    }
