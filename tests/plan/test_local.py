"""`--hardware local` in plan: measured numbers in, a catalog entry out; plan itself loads no torch."""

import subprocess
import sys

from fulcrum.plan.local import LocalMeasurements, local_hardware
from fulcrum.plan.model_spec import load_model_spec
from fulcrum.plan.roofline import decode_step

MEASURED = LocalMeasurements(
    dtype="fp32",
    threads=2,
    memory_bytes=8e9,
    bandwidth_by_batch={1: 10e9, 2: 12e9},
    matmul_flops=100e9,
    attention_flops=20e9,
    layer_overhead_s=100e-6,
    op_latency_s=5e-6,
    notes=["weight streaming (batch 1: 10.0 GB/s)"],
)


def test_measurements_become_a_catalog_entry():
    hw = local_hardware(MEASURED)
    assert hw.name == "local" and hw.source == "measured on this machine, 2 threads"
    assert hw.bandwidth == 10e9 and hw.stream_bandwidth(2) == 12e9 and hw.stream_bandwidth(4) == 10e9
    assert hw.flops == {"fp32": 100e9, "bf16": 100e9} and hw.formats == ("fp32",)
    assert hw.attention_rate("fp32") == 20e9 and hw.notes == MEASURED.notes


def test_a_decode_step_prices_the_measured_overhead():
    spec = load_model_spec("llama-3.1-8b")
    step = decode_step(spec, local_hardware(MEASURED), "bf16", "bf16", 1, 512)
    assert step.tpot_s > spec.num_layers * MEASURED.layer_overhead_s


def test_plan_imports_no_torch():
    code = "import sys, fulcrum.plan.cli, fulcrum.plan.validate; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
