"""Tool-call parsers for OpenAI-style tool calling on /v1/chat/completions: each reads one model
family's format out of the generated text, whole or streamed (--tool-call-parser picks one)."""

from __future__ import annotations

from fulcrum.server.tool_parsers.base import (
    CallCheck,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from fulcrum.server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from fulcrum.server.tool_parsers.hermes import HermesToolParser
from fulcrum.server.tool_parsers.llama3_json import Llama3JsonToolParser
from fulcrum.server.tool_parsers.mistral import MistralToolParser
from fulcrum.server.tool_parsers.pythonic import PythonicToolParser
from fulcrum.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        Qwen3CoderToolParser,
        PythonicToolParser,
        DeepSeekV3ToolParser,
    )
}


def get_tool_parser(name: str, tools: list[dict] | None = None, check: CallCheck | None = None) -> ToolParser:
    """A fresh parser for one request (streaming keeps state), given the request's `tools` and what a call must
    pass to be taken as one (base.CallCheck)."""
    try:
        cls = TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
    return cls(tools, check)


__all__ = [
    "TOOL_PARSERS",
    "DeepSeekV3ToolParser",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
]
