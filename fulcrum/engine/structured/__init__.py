"""Structured output: grammars (JSON schemas, regexes, choices, EBNF, structural tags) compiled with xgrammar,
one matcher per request advancing with its tokens, and the token bitmask the sampler applies."""

from fulcrum.engine.structured.grammar import GrammarState, StructuredOutputs, validate

__all__ = ["GrammarState", "StructuredOutputs", "validate"]
