"""Grammars through xgrammar (what vLLM and SGLang use by default): checked in the frontend without a
tokenizer, compiled in the engine core against the model's vocabulary once per spec (xgrammar's compiler caches
by spec), on a worker thread so a slow compile holds no step, and matched per request token by token."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import xgrammar as xgr

from fulcrum.defaults import (
    COMPILE_TIMEOUT_ENV,
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_GRAMMAR_BYTES,
    MAX_GRAMMAR_BYTES_ENV,
)
from fulcrum.errors import InvalidRequestError
from fulcrum.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

# A rollback window for speculative decoding: a verifier rejects at most this many proposed tokens at once.
MAX_ROLLBACK_TOKENS = 16
# JSON may put whitespace between tokens, but no more than this in a row: enough for indented output several levels
# deep, and a model that favours newlines (the bundled one does) cannot fill max_tokens with them
MAX_WHITESPACE = 20
ANY_OBJECT = '{"type": "object", "additionalProperties": true}'
# What one grammar may cost (bounds in fulcrum/defaults.py). A spec's size bounds its compile: a 1.5 MB schema of
# tens of thousands of properties kept a worker busy for minutes and the core at gigabytes.
# specs above this size compile on a worker of their own, so small ones never wait behind a large one
LARGE_SPEC_BYTES = 8 << 10


def max_grammar_bytes() -> int:
    return int(os.environ.get(MAX_GRAMMAR_BYTES_ENV, DEFAULT_MAX_GRAMMAR_BYTES))


def compile_timeout_s() -> float:
    return float(os.environ.get(COMPILE_TIMEOUT_ENV, DEFAULT_COMPILE_TIMEOUT_S))


def spec_bytes(spec: StructuredOutputsParams) -> int:
    """The size of what a spec asks xgrammar to compile."""
    text = {"json": spec.json, "regex": spec.regex, "grammar": spec.grammar, "structural_tag": spec.structural_tag}
    if spec.kind == "choice":
        return sum(len(c.encode()) for c in spec.choice)
    value = text.get(spec.kind)
    return len(value.encode()) if isinstance(value, str) else 0


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _parse_json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{what} is not valid JSON: {e}", param=what) from None


# JSON-schema keywords xgrammar enforces (each one is in the tests' schema suite), and those that only annotate.
# Anything else (uniqueItems, allOf, not, contains, if/then/else, dependentRequired ...) xgrammar would ignore and
# let through output that breaks the schema, so the schema is refused instead. oneOf is enforced as anyOf:
# alternatives that overlap are not made exclusive.
_SUBSCHEMA = {"items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems"}
_SUBSCHEMA_LISTS = {"anyOf", "oneOf", "prefixItems"}
_SUBSCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}
_ENFORCED = {
    "type", "required", "enum", "const", "$ref", "minItems", "maxItems", "minProperties", "maxProperties",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength",
    "pattern", "format",
} | _SUBSCHEMA | _SUBSCHEMA_LISTS | _SUBSCHEMA_MAPS  # fmt: skip
_ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "contentMediaType", "contentEncoding",
}  # fmt: skip


def unenforced_keywords(schema, path: str = "$") -> list[str]:
    """Where a JSON schema uses a keyword structured output cannot enforce, as 'keyword at path'."""
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    for key, value in schema.items():
        if key not in _ENFORCED and key not in _ANNOTATIONS:
            found.append(f"{key} at {path}")
        elif key in _SUBSCHEMA:
            found += unenforced_keywords(value, f"{path}.{key}")
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                found += unenforced_keywords(sub, f"{path}.{key}[{i}]")
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                found += unenforced_keywords(sub, f"{path}.{key}.{name}")
    if "format" in schema and ("minLength" in schema or "maxLength" in schema):
        found.append(f"minLength/maxLength together with format at {path}")
    return found


def validate(spec: StructuredOutputsParams) -> None:
    """Refuse, with a 400 naming the problem, a spec that does not parse or that xgrammar cannot support.
    Needs no tokenizer: building the grammar catches what compiling it would."""
    kind = spec.kind
    size, limit = spec_bytes(spec), max_grammar_bytes()
    if size > limit:
        name = {"json": "json_schema"}.get(kind, kind)
        raise InvalidRequestError(
            f"the {name} is {size:,} bytes; structured output takes specs up to {limit:,} bytes "
            "(fulcrum serve --max-grammar-bytes)",
            param=name,
        )
    try:
        if kind == "json":
            schema = _parse_json(spec.json, "json_schema")
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError("a JSON schema must be an object (or true/false)", param="json_schema")
            unenforced = unenforced_keywords(schema)
            if unenforced:
                raise InvalidRequestError(
                    f"the JSON schema uses what structured output cannot enforce: {', '.join(unenforced[:5])}",
                    param="json_schema",
                )
            xgr.Grammar.from_json_schema(spec.json, any_whitespace=not spec.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec.regex)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_choice_ebnf(spec.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec.grammar)
        elif kind == "structural_tag":
            _parse_json(spec.structural_tag, "structural_tag")
            xgr.Grammar.from_structural_tag(spec.structural_tag)
    except InvalidRequestError:
        raise
    except RecursionError:
        raise InvalidRequestError(f"the {kind} spec is nested too deeply for structured output", kind) from None
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types with a readable message
        what = {"json": "JSON schema", "grammar": "EBNF grammar", "structural_tag": "structural tag"}.get(kind, kind)
        raise InvalidRequestError(f"the {what} cannot be used for structured output: {_first_line(e)}", kind) from None


# xgrammar prefixes its messages with a time and its own source location ("[08:32:28] /project/cpp/x.cc:94: "):
# nothing a client can act on, and nothing to show them
_XGRAMMAR_PREFIX = re.compile(r"^(\[[0-9:]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[0] if len(text) < 2000 else text[:2000]
    return _XGRAMMAR_PREFIX.sub("", line) or line


class GrammarState:
    """One request's place in its grammar: which tokens may come next, advanced with each token it outputs
    and rolled back when tokens are taken back (speculative decoding's rejected proposals)."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK_TOKENS)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its end (EOS) was accepted."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputs:
    """The engine core's grammar compiler for one model: the tokenizer's vocabulary is read on first use (a
    server that never sees a grammar never pays for it)."""

    def __init__(self, tokenizer_path: str | Path, vocab_size: int, eos_token_ids: list[int], threads: int = 1):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        # Compiles release the GIL, so steps go on meanwhile. Two lanes of one worker each: large specs (a
        # 20,000-value enum took 10 s here) on one, the rest on the other, so that no number of slow grammars holds
        # a small one behind them
        self._small = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fulcrum-grammar")
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fulcrum-grammar-large")
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads) if threads > 1 else None
        self.compile_seconds: list[float] = []  # per compile, for the log and the closing figures

    def compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            from fulcrum.utils.tokenizer import load_tokenizer

            t0 = time.perf_counter()
            info = xgr.TokenizerInfo.from_huggingface(
                load_tokenizer(self.tokenizer_path), vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            log.info("structured output: vocabulary read in %.2f s", time.perf_counter() - t0)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        c = self.compiler()
        t0 = time.perf_counter()
        kind = spec.kind
        any_ws = not spec.disable_any_whitespace
        if kind == "json":
            out = c.compile_json_schema(spec.json, any_whitespace=any_ws, max_whitespace_cnt=MAX_WHITESPACE)
        elif kind == "json_object":
            # any object (xgrammar's builtin JSON grammar also takes arrays and scalars, and any whitespace)
            out = c.compile_json_schema(ANY_OBJECT, any_whitespace=any_ws, max_whitespace_cnt=MAX_WHITESPACE)
        elif kind == "regex":
            out = c.compile_regex(spec.regex)
        elif kind == "choice":
            out = c.compile_grammar(_choice_ebnf(spec.choice))
        elif kind == "grammar":
            out = c.compile_grammar(spec.grammar)
        else:
            out = c.compile_structural_tag(spec.structural_tag)
        self.compile_seconds.append(time.perf_counter() - t0)
        return out

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """Compile on a worker thread (its lane by the spec's size); the future's result is a fresh GrammarState.
        The future carries its deadline (`deadline`): the core ends a request whose grammar is not ready by then."""
        pool = self._large if spec_bytes(spec) > LARGE_SPEC_BYTES else self._small
        future = pool.submit(lambda: GrammarState(self.compile(spec)))
        future.deadline = time.monotonic() + compile_timeout_s()
        return future

    def fill_bitmask(self, states: list[GrammarState | None]) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed-token bitmask of a batch (int32, 32 tokens a word; rows without a grammar allow all) and the
        rows that have a grammar, or None when none has."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)  # all ones: everything allowed
        if self._batch is not None and len(rows) > 1:
            self._batch.batch_fill_next_token_bitmask([states[i].matcher for i in rows], bitmask, indices=rows)
        else:
            for i in rows:
                states[i].fill_bitmask(bitmask, i)
        return bitmask, rows

    def shutdown(self) -> None:
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)
