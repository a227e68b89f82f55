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
    assert cpu_ext.isa() == "none" and cpu_ext.load("fulcrum_unused", "", [], "avx2") is None


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
