"""The x86 ISA level fulcrum runs at: the CPU's own (from /proc/cpuinfo), or a lower one forced with
FULCRUM_CPU_ISA, applied to torch's own kernels too, so that a forced level runs as a machine of that level would.

Standard library only: `fulcrum/__init__.py` caps torch's kernels before anything can run a torch op (ATen picks
its vector level, oneDNN and MKL their ISA, once, at their first use).
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger(__name__)

# lowest first; amx is AVX-512 BF16 plus Intel's tile units, which fulcrum reaches through oneDNN's bf16 matmuls
ISA_LEVELS = ("none", "avx2", "avx512", "avx512_bf16", "amx")
_AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}
ISA_CPU_FLAGS = {
    "avx2": {"avx2", "fma"},
    "avx512": _AVX512,
    "avx512_bf16": _AVX512 | {"avx512_bf16"},
    "amx": _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"},
}
# What a forced level caps in torch: ATen's vectorized ops, oneDNN (bf16 matmuls, AMX) and MKL (fp32 GEMM), each
# named as that library spells it. "none" (below AVX2: SSE4 machines) caps them all to their SSE paths.
TORCH_ISA_ENV = {
    "none": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "avx512_bf16": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "amx": {},
}


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's flags, read once (the kernels' choices ask per call)."""
    return frozenset(_cpuinfo("flags").split())


@functools.cache
def vendor() -> str:
    """The CPU's vendor id (GenuineIntel, AuthenticAMD), read once: MKL picks its kernels by it."""
    return _cpuinfo("vendor_id")


def detected_isa() -> str:
    """The highest level this CPU has."""
    flags = cpu_flags()
    return next((lvl for lvl in reversed(ISA_LEVELS[1:]) if ISA_CPU_FLAGS[lvl] <= flags), "none")


def forced_isa() -> str | None:
    """FULCRUM_CPU_ISA when it names a level below the CPU's, else None (a higher one cannot be forced)."""
    forced = os.environ.get("FULCRUM_CPU_ISA")
    if not forced:
        return None
    if forced not in ISA_LEVELS:
        raise ValueError(f"FULCRUM_CPU_ISA must be one of {', '.join(ISA_LEVELS)}, got {forced!r}")
    return forced if ISA_LEVELS.index(forced) < ISA_LEVELS.index(detected_isa()) else None


def isa() -> str:
    """The level fulcrum's kernels are built for: the CPU's own, or a lower one forced with FULCRUM_CPU_ISA (so
    every path can be tested on a machine that has a higher one); FULCRUM_CPU_KERNELS=0 turns them all off
    (and leaves torch as it is: an A/B switch for fulcrum's kernels alone)."""
    if os.environ.get("FULCRUM_CPU_KERNELS", "1") == "0":
        return "none"
    return forced_isa() or detected_isa()


def at_least(level: str) -> bool:
    return ISA_LEVELS.index(isa()) >= ISA_LEVELS.index(level)


def torch_at_least(level: str) -> bool:
    """Whether torch's own kernels (oneDNN, MKL) may run at `level` here: the CPU's level, or the forced one.
    FULCRUM_CPU_KERNELS=0 turns off fulcrum's kernels only, so it does not count."""
    return ISA_LEVELS.index(forced_isa() or detected_isa()) >= ISA_LEVELS.index(level)


def best(*levels: str) -> str:
    """The first of `levels` (highest first) that this CPU, under FULCRUM_CPU_ISA, has; the last one otherwise
    (whose kernel then does not load when the CPU is below it)."""
    return next((lvl for lvl in levels if at_least(lvl)), levels[-1])


def cap_torch() -> dict[str, str]:
    """Under a forced level, tell torch's libraries not to go above it (environment variables they read at
    their first use; one the user set stays as it is). Returns what it set."""
    try:
        level = forced_isa()
    except ValueError:
        return {}  # isa() raises it where a kernel is chosen, with the message
    if level is None:
        return {}
    wanted = {k: v for k, v in TORCH_ISA_ENV[level].items() if k not in os.environ}
    os.environ.update(wanted)
    return wanted


def torch_capability() -> str:
    """The vector level torch's own ops run at here ("AVX2", "AVX512", "DEFAULT"); imports torch."""
    import torch

    return torch.backends.cpu.get_cpu_capability()
