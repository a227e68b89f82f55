"""Every kernel's source compiles at every ISA level, whatever this CPU runs: a machine with AVX2 only still
checks that its AVX-512 and AVX-512 BF16 builds compile (it cannot run them; test_isa_paths runs the levels
this CPU has)."""

import shutil
import subprocess

import pytest

from fulcrum.kernels import cpu_attention, cpu_ext, cpu_gemv, cpu_norm

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")

SOURCES = {
    "gemv": cpu_gemv._source,
    "attention": lambda lvl: cpu_ext.vector_prelude(lvl) + cpu_attention._BODY,
    "norm": lambda lvl: cpu_norm._SOURCE,
}


# attention has no AVX-512 BF16 build of its own (it is built at AVX-512 there)
BUILDS = [("gemv", lvl) for lvl in ("avx2", "avx512", "avx512_bf16")] + [("attention", "avx2"), ("attention", "avx512")]
BUILDS += [("norm", lvl) for lvl in ("avx2", "avx512", "avx512_bf16")]


@pytest.mark.parametrize("kernel, level", BUILDS)
def test_compiles_at_every_level(kernel, level, tmp_path):
    src = tmp_path / f"{kernel}.cpp"
    src.write_text(SOURCES[kernel](level))
    cmd = cpu_ext.compile_command(str(src), str(tmp_path / f"{kernel}.o"), cpu_ext.ISA_FLAGS[level], link=False)
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
