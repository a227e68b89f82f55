"""fulcrum: an LLM inference engine and inference-engineering toolkit."""

__version__ = "0.1.0"
