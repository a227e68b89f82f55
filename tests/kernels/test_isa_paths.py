"""Every code path stays tested on any machine: the engine's parity tests and the quantized paths run again, in a
process of their own, at each ISA level below this CPU's (FULCRUM_CPU_ISA, torch's own kernels capped with it),
down to none (PyTorch ops only)."""

import os
import subprocess
import sys

import pytest

from fulcrum.kernels import cpu_ext

LOWER = [lvl for lvl in cpu_ext.ISA_LEVELS if cpu_ext.ISA_LEVELS.index(lvl) < cpu_ext.ISA_LEVELS.index(cpu_ext.isa())]


@pytest.mark.parametrize("level", LOWER or ["none"])
def test_engine_parity_at_a_forced_lower_level(level):
    env = {**os.environ, "FULCRUM_CPU_ISA": level}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine/test_llm_parity.py",
           "tests/kernels/test_cpu_qgemv.py", "tests/quant/test_quantized_engine.py", "tests/kernels/test_kv_quant.py",
           "tests/kernels/test_cpu_attention.py", "tests/kernels/test_cpu_act.py", "tests/kernels/test_cpu_decode_stack.py",
           "tests/kernels/test_cpu_prepack.py", "tests/kernels/test_bf16_widen.py", "tests/kernels/test_cpu_argmax.py",
           "tests/models/test_gguf_quant.py::test_each_block_type_gives_the_logits_of_its_dequantized_weights"]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " passed" in res.stdout
