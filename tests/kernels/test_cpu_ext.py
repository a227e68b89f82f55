"""ISA levels: the CPU's own, a lower one forced with FULCRUM_CPU_ISA (so every path is testable on a higher
machine), none with FULCRUM_CPU_KERNELS=0; each kernel loads only at or above the level it is built for."""

import pytest

from fulcrum.kernels import cpu_ext


def test_a_lower_level_can_be_forced_never_a_higher_one(monkeypatch):
    monkeypatch.setattr(cpu_ext, "detected_isa", lambda: "avx512")
    monkeypatch.setenv("FULCRUM_CPU_ISA", "avx2")
    assert cpu_ext.isa() == "avx2" and cpu_ext.at_least("avx2") and not cpu_ext.at_least("avx512")
    monkeypatch.setenv("FULCRUM_CPU_ISA", "avx512_bf16")
    assert cpu_ext.isa() == "avx512"
    monkeypatch.setenv("FULCRUM_CPU_ISA", "none")
    assert cpu_ext.isa() == "none" and cpu_ext.load("fulcrum_unused", "", "avx2") is None


def test_kernels_off_and_bad_values(monkeypatch):
    monkeypatch.setenv("FULCRUM_CPU_KERNELS", "0")
    assert cpu_ext.isa() == "none"
    monkeypatch.delenv("FULCRUM_CPU_KERNELS")
    monkeypatch.setenv("FULCRUM_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="FULCRUM_CPU_ISA"):
        cpu_ext.isa()


def test_detected_level_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"})
    assert cpu_ext.detected_isa() == "avx512"
    monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda: {"avx2"})  # AVX2 without FMA is below the floor
    assert cpu_ext.detected_isa() == "none"


def test_a_source_that_does_not_compile_leaves_pytorch_ops(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("FULCRUM_CACHE", str(tmp_path))
    if not cpu_ext.at_least("avx2"):
        pytest.skip("below AVX2 nothing is built")
    assert cpu_ext.load("fulcrum_broken", "this is not C++", "avx2") is None
    assert "fulcrum_broken unavailable" in caplog.text


def test_a_built_library_is_reused_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FULCRUM_CACHE", str(tmp_path))
    if not cpu_ext.at_least("avx2"):
        pytest.skip("below AVX2 nothing is built")
    source = cpu_ext.PRELUDE + 'extern "C" int64_t answer() { return 42; }\n'
    lib = cpu_ext.load("fulcrum_answer", source, "avx2")
    assert cpu_ext.bind(lib.answer, cpu_ext.I64)() == 42
    calls = []
    monkeypatch.setattr(cpu_ext.subprocess, "run", lambda *a, **k: calls.append(a))
    assert cpu_ext.load("fulcrum_answer", source, "avx2") is not None and calls == []
