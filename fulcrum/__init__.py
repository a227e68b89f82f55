"""fulcrum: an LLM inference engine and inference-engineering toolkit."""

from fulcrum.defaults import VERSION as __version__  # noqa: F401  (the package's version)
from fulcrum.utils import cpu_isa

# Before any torch op: under FULCRUM_CPU_ISA, torch's own kernels (ATen, oneDNN, MKL) run at that level too
cpu_isa.cap_torch()


def __getattr__(name):
    # `from fulcrum import LLM, SamplingParams` without importing torch for every CLI call
    if name == "LLM":
        from fulcrum.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fulcrum.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
