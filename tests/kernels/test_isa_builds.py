"""Every kernel's source (csrc/) compiles at every ISA level, whatever this CPU runs: a machine with AVX2 only still
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
from fulcrum.runtime import cpu_threads
from fulcrum.utils.cpu_isa import cpu_flags

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")

# each build: the source in csrc/ and its -D macros
SOURCES = {
    "gemv": ("gemv.cpp", {}),
    "decode attention": ("decode_attention.cpp", {"QUANTIZED_KV": 0}),
    "decode attention, quantized KV": ("decode_attention.cpp", {"QUANTIZED_KV": 1}),
    "prefill attention": ("prefill_attention.cpp", {}),
    "norm": ("norm.cpp", {}),
    "act": ("act.cpp", {}),
    "argmax": ("argmax.cpp", {}),
    "rope": ("rope.cpp", {}),
    "decode stack": ("decode_stack.cpp", {}),
    "packed linear": ("packed_linear.cpp", {}),
    "blocked linear": ("blocked_linear.cpp", {}),
    "qgemv": ("qgemv.cpp", {}),
    "qgemv_vnni": ("qgemv_vnni.cpp", {}),
}
EXTRA_FLAGS = {"qgemv_vnni": ["-mavx512vnni"]}


# the vector kernels have no AVX-512 BF16 build of their own (they are built at AVX-512 there)
BUILDS = [("gemv", lvl) for lvl in ("avx2", "avx512", "avx512_bf16")]
BUILDS += [(kernel, lvl) for kernel in ("decode attention", "prefill attention", "norm", "act", "argmax", "qgemv")
           for lvl in ("avx2", "avx512")]  # fmt: skip
BUILDS += [("decode attention, quantized KV", "avx512"), ("rope", "avx2"), ("decode stack", "avx2")]
BUILDS += [("packed linear", "avx2")]
BUILDS += [("blocked linear", lvl) for lvl in ("avx2", "avx512", "avx512_bf16")]
BUILDS += [("qgemv_vnni", "avx512_bf16")]


@pytest.mark.parametrize("kernel, level", BUILDS)
def test_compiles_at_every_level(kernel, level, tmp_path):
    source, defines = SOURCES[kernel]
    flags = [*cpu_ext.ISA_FLAGS[level], *EXTRA_FLAGS.get(kernel, []), *(f"-D{k}={v}" for k, v in defines.items())]
    cmd = cpu_ext.compile_command(str(cpu_ext.CSRC / source), str(tmp_path / "kernel.o"), flags, link=False)
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
    "thread placement": (lambda: cpu_threads._lib() is not None, "none"),
}


@pytest.mark.parametrize("kernel", sorted(RUNNABLE))
def test_every_kernel_this_cpu_can_run_is_built(kernel):
    available, level = RUNNABLE[kernel]
    if not cpu_ext.at_least(level) or (kernel == "qgemv_vnni" and "avx512_vnni" not in cpu_flags()):
        pytest.skip(f"{kernel} needs {level}; kernels here run at {cpu_ext.isa()}")
    assert available(), f"{kernel} did not build (the log names the compiler error)"
