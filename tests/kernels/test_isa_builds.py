"""Every kernel's source compiles at every ISA level, whatever this CPU runs: a machine with AVX2 only still
checks that its AVX-512 and AVX-512 BF16 builds compile (it cannot run them; test_isa_paths runs the levels
this CPU has)."""

import shutil
import subprocess

import pytest

from fulcrum.kernels import (
    cpu_act,
    cpu_argmax,
    cpu_attention,
    cpu_decode_stack,
    cpu_ext,
    cpu_gemv,
    cpu_norm,
    cpu_qgemv,
    cpu_qgemv_vnni,
    cpu_rope,
)
from fulcrum.utils.cpu_isa import cpu_flags

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")

SOURCES = {
    "gemv": cpu_gemv._source,
    "attention": lambda lvl: cpu_ext.vector_prelude(lvl) + cpu_attention._BODY,
    "norm": lambda lvl: cpu_ext.vector_prelude(lvl) + "#include <cmath>\n" + cpu_norm._BODY,
    "act": lambda lvl: cpu_ext.vector_prelude(lvl) + "#include <cmath>\n" + cpu_act._BODY,
    "argmax": lambda lvl: cpu_ext.vector_prelude(lvl) + "#include <cmath>\n" + cpu_argmax._BODY,
    "qgemv": lambda lvl: cpu_ext.vector_prelude(lvl) + cpu_qgemv._LOADS[lvl] + cpu_qgemv._BODY,
    "qgemv_vnni": lambda lvl: cpu_qgemv_vnni._SOURCE,
}
EXTRA_FLAGS = {"qgemv_vnni": ["-mavx512vnni"]}


# attention has no AVX-512 BF16 build of its own (it is built at AVX-512 there)
BUILDS = [("gemv", lvl) for lvl in ("avx2", "avx512", "avx512_bf16")] + [("attention", "avx2"), ("attention", "avx512")]
BUILDS += [(kernel, lvl) for kernel in ("norm", "act", "argmax") for lvl in ("avx2", "avx512")]
BUILDS += [("qgemv", "avx2"), ("qgemv", "avx512"), ("qgemv_vnni", "avx512_bf16")]


@pytest.mark.parametrize("kernel, level", BUILDS)
def test_compiles_at_every_level(kernel, level, tmp_path):
    src = tmp_path / f"{kernel}.cpp"
    src.write_text(SOURCES[kernel](level))
    cmd = cpu_ext.compile_command(
        str(src), str(tmp_path / f"{kernel}.o"), [*cpu_ext.ISA_FLAGS[level], *EXTRA_FLAGS.get(kernel, [])], link=False
    )
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


# A kernel whose build fails falls back to PyTorch ops with a warning, and its own tests skip as "unavailable": on a
# CPU that has the kernel's level, that would hide a compile error behind skips. Here it fails instead.
RUNNABLE = {
    "gemv": (cpu_gemv.available, "avx2"),
    "norm": (cpu_norm.available, "avx2"),
    "act": (cpu_act.available, "avx2"),
    "argmax": (cpu_argmax.available, "avx2"),
    "rope": (cpu_rope.available, "avx2"),
    "attention": (cpu_attention.available, "avx2"),
    "attention, quantized KV": (lambda: cpu_attention.available(quantized_kv=True), "avx2"),
    "decode stack": (cpu_decode_stack.available, "avx2"),
    "qgemv": (cpu_qgemv.available, "avx2"),
    "qgemv_vnni": (cpu_qgemv_vnni.available, "avx512_bf16"),
}


@pytest.mark.parametrize("kernel", sorted(RUNNABLE))
def test_every_kernel_this_cpu_can_run_is_built(kernel):
    available, level = RUNNABLE[kernel]
    if not cpu_ext.at_least(level) or (kernel == "qgemv_vnni" and "avx512_vnni" not in cpu_flags()):
        pytest.skip(f"{kernel} needs {level}; kernels here run at {cpu_ext.isa()}")
    assert available(), f"{kernel} did not build (the log names the compiler error)"
