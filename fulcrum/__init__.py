"""fulcrum: an LLM inference engine and inference-engineering toolkit."""

__version__ = "0.1.0"


def __getattr__(name):
    # `from fulcrum import LLM, SamplingParams` without importing torch for every CLI call
    if name == "LLM":
        from fulcrum.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fulcrum.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
