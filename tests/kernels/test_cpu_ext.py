"""ISA levels: the CPU's own, a lower one forced with FULCRUM_CPU_ISA (so every path is testable on a higher
machine), none with FULCRUM_CPU_KERNELS=0; each kernel loads only at or above the level it is built for."""

import os
import subprocess
import sys

import pytest

from fulcrum.kernels import cpu_ext
from fulcrum.utils import cpu_isa


def test_a_lower_level_can_be_forced_never_a_higher_one(monkeypatch):
    monkeypatch.setattr(cpu_isa, "detected_isa", lambda: "avx512")
    monkeypatch.setenv("FULCRUM_CPU_ISA", "avx2")
    assert cpu_ext.isa() == "avx2" and cpu_ext.at_least("avx2") and not cpu_ext.at_least("avx512")
    monkeypatch.setenv("FULCRUM_CPU_ISA", "avx512_bf16")
    assert cpu_ext.isa() == "avx512"
    monkeypatch.setenv("FULCRUM_CPU_ISA", "none")
    assert cpu_ext.isa() == "none" and cpu_ext.load("act.cpp", "avx2", {}) is None


def test_kernels_off_and_bad_values(monkeypatch):
    monkeypatch.setenv("FULCRUM_CPU_KERNELS", "0")
    assert cpu_ext.isa() == "none"
    monkeypatch.delenv("FULCRUM_CPU_KERNELS")
    monkeypatch.setenv("FULCRUM_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="FULCRUM_CPU_ISA"):
        cpu_ext.isa()


def test_detected_level_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"})
    assert cpu_ext.detected_isa() == "avx512"
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: {"avx2"})  # AVX2 without FMA is below the floor
    assert cpu_ext.detected_isa() == "none"
    amx = cpu_isa.ISA_CPU_FLAGS["avx512_bf16"] | {"amx_tile", "amx_bf16", "amx_int8"}
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: amx)
    assert cpu_ext.detected_isa() == "amx"
    monkeypatch.setenv("FULCRUM_CPU_ISA", "avx512_bf16")  # AMX off: oneDNN capped below its tiles
    assert cpu_ext.isa() == "avx512_bf16" and cpu_isa.TORCH_ISA_ENV["avx512_bf16"]["ONEDNN_MAX_CPU_ISA"]
    # the kernels an AMX machine loads are the AVX-512 BF16 builds
    monkeypatch.delenv("FULCRUM_CPU_ISA")
    assert cpu_ext.best("avx512_bf16", "avx512", "avx2") == "avx512_bf16"


def test_a_source_that_does_not_compile_leaves_pytorch_ops(monkeypatch, tmp_path, caplog):
    """...with a warning whose compiler error names the source file and line, compiled where it lies."""
    monkeypatch.setenv("FULCRUM_CACHE", str(tmp_path / "cache"))
    if not cpu_ext.at_least("avx2"):
        pytest.skip("below AVX2 nothing is built")
    broken = tmp_path / "broken.cpp"
    broken.write_text('#include "prelude.h"\n\nthis is not C++\n')
    assert cpu_ext.load(broken, "avx2", {}) is None
    assert "broken_avx2 unavailable" in caplog.text and f"{broken}:3" in caplog.text


def test_a_built_library_is_reused_from_the_cache_until_a_header_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("FULCRUM_CACHE", str(tmp_path / "cache"))
    if not cpu_ext.at_least("avx2"):
        pytest.skip("below AVX2 nothing is built")
    source, header = tmp_path / "answer.cpp", tmp_path / "answer.h"
    source.write_text('#include "prelude.h"\n#include "answer.h"\nextern "C" int64_t answer() { return ANSWER; }\n')
    header.write_text("#define ANSWER 42\n")
    lib = cpu_ext.load(source, "avx2", {})
    assert cpu_ext.bind(lib.answer, cpu_ext.I64)() == 42
    run = cpu_ext.subprocess.run
    calls = []
    monkeypatch.setattr(cpu_ext.subprocess, "run", lambda *a, **k: calls.append(a))
    assert cpu_ext.load(source, "avx2", {}) is not None and calls == []
    # the key covers every included file's contents, not only the .cpp's
    monkeypatch.setattr(cpu_ext.subprocess, "run", lambda *a, **k: calls.append(a) or run(*a, **k))
    header.write_text("#define ANSWER 43\n")
    lib = cpu_ext.load(source, "avx2", {})
    assert len(calls) == 1 and cpu_ext.bind(lib.answer, cpu_ext.I64)() == 43
    assert {"answer.cpp", "answer.h", "prelude.h"} <= {os.path.basename(k) for k in cpu_ext.sources(source)}


def test_a_forced_level_caps_torchs_own_kernels_too(monkeypatch):
    """FULCRUM_CPU_ISA=avx2 on a higher machine: ATen's vectorized ops (and oneDNN, MKL) run at AVX2, as on an
    AVX2 machine, not only fulcrum's kernels; a variable the user set stays as it is."""
    if cpu_isa.detected_isa() in ("none", "avx2"):
        pytest.skip("needs a CPU above AVX2 to force a lower level")
    code = "import fulcrum, os, torch; print(torch.backends.cpu.get_cpu_capability(), os.environ['ONEDNN_MAX_CPU_ISA'])"
    env = {**os.environ, "FULCRUM_CPU_ISA": "avx2"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["AVX2", "AVX2"]
    env["ONEDNN_MAX_CPU_ISA"] = "AVX2_VNNI"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["AVX2", "AVX2_VNNI"]
    env.pop("FULCRUM_CPU_ISA")
    env.pop("ONEDNN_MAX_CPU_ISA")
    code = (
        "import fulcrum, os, torch; print(torch.backends.cpu.get_cpu_capability(), 'ONEDNN_MAX_CPU_ISA' in os.environ)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["AVX512", "False"]
