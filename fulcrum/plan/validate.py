"""`fulcrum plan --validate`: predict the engine's prefill and decode speed on this machine from the model's
config and measured hardware figures, then run the engine and put the two side by side, with the weight bytes the
engine holds against the predicted ones. An online quantization (`--quantization int8|int4|fp8`) and a KV-cache
dtype (`--kv-cache-dtype fp8|int8`) go to both sides. The measuring is `fulcrum.probe`'s, passed in by the CLI:
`measure_machine` returns `LocalMeasurements`, `measure_engine` the engine's speed as a dict, and `step_costs` (when
given) this machine's calibrated step-cost model and where it came from: prefill and TPOT are then predicted as the
cost of their steps (`fulcrum.plan.step_costs`, the model `fulcrum sim` runs on), else from the roofline of the
measured machine figures."""

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
from fulcrum.plan.step_costs import StepCosts, decode_seconds, prefill_seconds

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


def describe_costs(costs: StepCosts) -> str:
    """Where a step-cost model comes from, in one line: its engine, its machine and its held-out error."""
    e, held = costs.engine, costs.fit.get("held_out", {})
    error = f"held-out error {held['mean_abs_rel_error']:.1%} mean" if held.get("steps") else "no held-out error"
    flags = ", ".join(costs.machine.get("flags", []))
    return (
        f"{costs.source} step costs: {e.get('dtype', '?')}, KV {e.get('kv_cache_dtype', '?')}, "
        f"quantization {e.get('quantization') or 'none'}, {e.get('threads', '?')} thread(s) on "
        f"{costs.machine.get('cpu') or 'this CPU'}" + (f" ({flags})" if flags else "") + f"; {error}"
    )


def roofline_predictions(c: Console, spec: ModelSpec, dtype: str, kv_dtype: str, quant: OnlineQuant | None,
                         measure_machine: Callable[..., LocalMeasurements], input_len: int,
                         batch_sizes: tuple[int, ...], context: int, kv_cache_dtype: str) -> tuple[float, dict, str, dict]:  # fmt: skip
    """Prefill seconds and TPOT by batch from the roofline of this machine's measured figures, and the line that
    explains the batch-1 figure."""
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
    d1 = pred_decode[batch_sizes[0]]
    explained = (
        f"decode batch {batch_sizes[0]} predicted: {d1.bytes_per_step / 1e6:,.1f} MB read per step at "
        f"{hw.bandwidth / 1e9:.1f} GB/s = {d1.bytes_per_step / hw.bandwidth * 1e3:.2f} ms, plus {over * 1e3:.2f} ms "
        "overhead"
    )
    hardware = {
        "bandwidth_gbs_by_batch": {b: v / 1e9 for b, v in hw.bandwidth_by_batch.items()},
        "flops": hw.flops,
        "op_latency_us": hw.op_latency_s * 1e6,
    }
    return pred_prefill.seconds, {b: d.tpot_s for b, d in pred_decode.items()}, explained, hardware


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
    step_costs: Callable[[], tuple[StepCosts, str]] | None = None,
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
    costs = None
    if step_costs is not None:
        costs, where = step_costs()
        c.print(f"  step costs: {where}")
        c.print("  " + describe_costs(costs))
        # the engine measured computes a prompt in one step (measure_engine's max_num_batched_tokens)
        pred_prefill_s = prefill_seconds(costs, input_len, max(input_len, decode_prompt_len * max(batch_sizes)))
        pred_tpot = {b: decode_seconds(costs, b, context) for b in batch_sizes}
        explained = f"decode batch {batch_sizes[0]} predicted: a step of {batch_sizes[0]} row(s) over {context} tokens"
        hardware = {"step_costs": where, "engine": costs.engine, "machine": costs.machine, "fit": costs.fit}
    else:
        pred_prefill_s, pred_tpot, explained, hardware = roofline_predictions(
            c, spec, dtype, kv_dtype, quant, measure_machine, input_len, batch_sizes, context, kv_cache_dtype
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
        Comparison(f"prefill {input_len} tokens (tokens/s)", input_len / pred_prefill_s, got["prefill_tokens_per_s"])
    ]
    for b, tpot in pred_tpot.items():
        m = got["decode"][b]
        rows.append(Comparison(f"decode batch {b}: TPOT (ms)", tpot * 1e3, m["tpot_s"] * 1e3))
        rows.append(Comparison(f"decode batch {b}: tokens/s", b / tpot, m["tokens_per_s"]))
    rows.append(Comparison("resident weights (MB)", predicted_weights / 1e6, got["weight_bytes"] / 1e6))

    c.print(f"predicted for: weights {quant.name if quant else dtype}, KV cache {kv_dtype}")
    layers = f", {got['quantized_layers']} layers quantized" if quantization else ""
    c.print(f"measured with: weights {got['quantization']}{layers}, KV cache {got['kv_cache_dtype']}")
    if costs is not None:
        for line in mismatches(costs, got, quantization):
            c.print(f"  [yellow]note[/yellow]: {line}")
    how = "calibrated step costs" if costs is not None else "roofline + overhead"
    t = Table(title=f"{spec.name}: predicted ({how}) against measured (engine)")
    for col in ("quantity", "predicted", "measured", "error"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r.quantity, f"{r.predicted:,.2f}", f"{r.measured:,.2f}", f"{r.error:+.0%}")
    c.print(t)
    c.print(
        f"{explained}; engine weights {got['weight_bytes'] / 1e6:,.2f} MB "
        f"({got['engine_weight_bytes'] / 1e6:,.2f} MB with the RoPE tables), {got['threads']} threads"
    )
    return {
        "model": spec.name,
        "dtype": dtype,
        "quantization": {"method": quant.method, "group_size": quant.group_size} if quant else None,
        "kv_cache_dtype": kv_dtype,
        "predicted_weight_bytes": predicted_weights,
        "hardware": hardware,
        "comparisons": [{**r.__dict__, "error": r.error} for r in rows],
        "measured": got,
    }


def mismatches(costs: StepCosts, got: dict, quantization: str | None) -> list[str]:
    """Where the cost file's engine is not the one measured (a prediction for another engine, said so)."""
    e, out = costs.engine, []
    if e.get("threads") not in (None, got["threads"]):
        out.append(f"the step costs were calibrated with {e['threads']} thread(s); the engine ran {got['threads']}")
    if (e.get("quantization") or None) != quantization:
        out.append(f"the step costs were calibrated with quantization {e.get('quantization') or 'none'}; the engine "
                   f"ran {quantization or 'none'}")  # fmt: skip
    if e.get("kv_cache_dtype") and not str(got["kv_cache_dtype"]).startswith(str(e["kv_cache_dtype"])):
        out.append(f"the step costs were calibrated with a {e['kv_cache_dtype']} KV cache; the engine ran "
                   f"{got['kv_cache_dtype']}")  # fmt: skip
    return out
