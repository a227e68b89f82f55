"""Grammars through xgrammar (what vLLM and SGLang use by default): checked in the frontend without a
tokenizer, compiled in the engine core against the model's vocabulary once per spec (xgrammar's compiler caches
by spec), on a worker thread so a slow compile holds no step, and matched per request token by token."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import xgrammar as xgr

from fulcrum.defaults import (
    COMPILE_MEMORY_ENV,
    COMPILE_TIMEOUT_ENV,
    DEFAULT_COMPILE_MEMORY_MB,
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_GRAMMAR_BYTES,
    MAX_GRAMMAR_BYTES_ENV,
)
from fulcrum.engine.structured.compile_worker import CompileLane, CompileRefused
from fulcrum.errors import InvalidRequestError
from fulcrum.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

# A rollback window for speculative decoding: a verifier rejects at most this many proposed tokens at once.
MAX_ROLLBACK_TOKENS = 16
# JSON may put whitespace between tokens, but no more than MAX_WHITESPACE in a row unless the client asks for free
# whitespace (disable_any_whitespace: false, given): a model that favours newlines fills every gap it is allowed to.
# The bundled model on {name (maxLength 10), age (0-120), tags (up to 3 strings of up to 8)}, 16 seeds at
# temperature 1 plus greedy, prompted plainly and through its chat template (issue 37), tokens (median plain/chat, max):
#   20 a gap: none of 34 finished within 200 | 8: 104/107, 160, 20 of 32 within 120 | 4: 72/69, 104
#   2: 51/61, 78 | 1: 52/61, 67 | no free whitespace (disable_any_whitespace: true): 37/38, 59
# Two a gap leaves room for `{"a": 1}`, `{ "a" : 1 }` or a newline and a space, for 14-23 tokens (medians) over
# none. (A string without maxLength the bundled model seldom closes, whatever the whitespace.)
MAX_WHITESPACE = 2
FREE_WHITESPACE = 20  # what a client that asks for free whitespace gets: indented output several levels deep
ANY_OBJECT = '{"type": "object", "additionalProperties": true}'
# What one grammar may cost (bounds in fulcrum/defaults.py). A spec's size bounds its compile: a 1.5 MB schema of
# tens of thousands of properties kept a worker busy for minutes and the core at gigabytes.
# specs above this size compile on a worker of their own, so small ones never wait behind a large one
LARGE_SPEC_BYTES = 8 << 10
# A compiled grammar may take this much (its token-mask cache; an 11 KB schema of 400 optional properties takes
# ~100 MB), and the core keeps compiled grammars by spec up to GRAMMAR_CACHE_BYTES in all
MAX_COMPILED_GRAMMAR_BYTES = 256 << 20
GRAMMAR_CACHE_BYTES = 512 << 20
# specs the compiler refused, kept by spec with the reason (the newest this many): sent again, one is refused at once
# instead of compiled again (a schema that fails at the memory limit costs seconds of CPU each time)
REFUSED_CACHE_SPECS = 1024


def max_whitespace(spec: StructuredOutputsParams) -> int:
    """Whitespace allowed in a row between JSON tokens: free when the client set disable_any_whitespace false."""
    return FREE_WHITESPACE if spec.disable_any_whitespace is False else MAX_WHITESPACE


def max_grammar_bytes() -> int:
    return int(os.environ.get(MAX_GRAMMAR_BYTES_ENV, DEFAULT_MAX_GRAMMAR_BYTES))


def compile_timeout_s() -> float:
    return float(os.environ.get(COMPILE_TIMEOUT_ENV, DEFAULT_COMPILE_TIMEOUT_S))


def grammar_memory_bytes() -> int:
    """What one compile may take beyond its worker's inherited memory (--grammar-compile-memory)."""
    return int(float(os.environ.get(COMPILE_MEMORY_ENV, DEFAULT_COMPILE_MEMORY_MB)) * 2**20)


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
# What xgrammar 0.2.9 lets through silently, found by experiment (issue 37), and refused here instead:
# - a keyword of one type (maxLength, minimum, required ...) without a `type` that names it: any value passes.
#   Only items/prefixItems/unevaluatedItems imply an array, properties/additionalProperties/unevaluatedProperties
#   an object (and propertyNames' own schema a string);
# - anything beside $ref, anyOf or oneOf but annotations, and beside enum or const anything but `type` (and values
#   that do not fit it): the sibling is dropped;
# - `required` naming no property in `properties`: dropped, whatever additionalProperties says;
# - a $ref that is not a local JSON pointer ("#", "#/..."): any value; a format it does not know: any string;
#   multipleOf on numbers or with a fraction: ignored; pattern with minLength/maxLength: the lengths ignored;
#   negative lengths and counts: ignored; an empty type list or anyOf: anything, or nothing at all;
# - look-ahead in a pattern: dropped (the same regex as guided_regex is refused), and what from_regex accepts but
#   drops too (an anchor inside the regex, an escape it does not know): see regex_fault.
_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
_OF_TYPE = {
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), "string"),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), "number"),
    **dict.fromkeys(("items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"), "array"),
    **dict.fromkeys(
        ("properties", "additionalProperties", "unevaluatedProperties", "required", "minProperties", "maxProperties",
         "patternProperties", "propertyNames"),
        "object",
    ),
}  # fmt: skip
_IMPLIED = {  # keywords from which xgrammar takes a schema without `type` to be of a type
    "array": {"items", "prefixItems", "unevaluatedItems"},
    "object": {"properties", "additionalProperties", "unevaluatedProperties"},
}
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_MAX_COUNT = 2**31 - 1  # xgrammar's
# the string formats xgrammar enforces; "password" and "binary" (OpenAPI's, pydantic's SecretStr and bytes) only
# annotate: any string is right for them
_FORMATS = {
    "email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer",
}  # fmt: skip
_HINT_FORMATS = {"password", "binary"}


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _fits(value, types: set[str]) -> bool:
    """A value (of enum or const) is of one of the JSON-schema types."""
    of = {
        "null": value is None,
        "boolean": isinstance(value, bool),
        "integer": _is_number(value) and float(value).is_integer(),
        "number": _is_number(value),
        "string": isinstance(value, str),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }
    return any(of[t] for t in types)


def _resolve(root, ref: str):
    """The schema a local JSON pointer ("#", "#/$defs/a") points to, or None."""
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _SchemaCheck:
    """One walk over a JSON schema: the keywords structured output does not enforce (`unenforced`, as 'keyword at
    path') and the values it would let pass silently (`faults`, as 'path: problem')."""

    def __init__(self, root):
        self.root = root
        self.unenforced: list[str] = []
        self.faults: list[str] = []

    def fault(self, path: str, problem: str) -> None:
        self.faults.append(f"{path}: {problem}")

    def walk(self, schema, path: str = "$", implied: str | None = None) -> None:
        if isinstance(schema, bool):
            return
        if not isinstance(schema, dict):
            return self.fault(path, "a schema must be an object or true/false")
        for key, value in schema.items():
            at = f"{path}.{key}"
            if key not in _ENFORCED and key not in _ANNOTATIONS:
                self.unenforced.append(f"{key} at {path}")
            elif key in _SUBSCHEMA:
                self.walk(value, at, "string" if key == "propertyNames" else None)
            elif key in _SUBSCHEMA_LISTS:
                if not isinstance(value, list) or not value:
                    self.fault(at, "must be a non-empty list of schemas")
                    continue
                for i, sub in enumerate(value):
                    self.walk(sub, f"{at}[{i}]")
            elif key in _SUBSCHEMA_MAPS:
                if not isinstance(value, dict):
                    self.fault(at, "must be an object")
                    continue
                for name, sub in value.items():
                    if key == "patternProperties" and (problem := regex_fault(name)):
                        self.fault(f"{at}.{name}", problem)
                    self.walk(sub, f"{at}.{name}")
        for what in ("format", "pattern"):
            if what in schema and ("minLength" in schema or "maxLength" in schema):
                self.unenforced.append(f"minLength/maxLength together with {what} at {path}")
        if "propertyNames" in schema and "properties" in schema:
            self.unenforced.append(f"propertyNames together with properties at {path}")
        self.check(schema, path, implied)

    def check(self, schema: dict, path: str, implied: str | None) -> None:
        """The keywords of one schema (not its subschemas)."""
        keys = set(schema) - _ANNOTATIONS - {"$defs", "definitions"}
        declared = schema.get("type")
        if "type" in schema:
            names = [declared] if isinstance(declared, str) else declared
            if not isinstance(names, list) or not names or any(t not in _TYPES for t in names):
                return self.fault(f"{path}.type", f"must be one of {', '.join(sorted(_TYPES))}, or a list of them")
            types = set(names)
        else:
            types = {implied} if implied else set()
            types |= {t for t, words in _IMPLIED.items() if keys & words}
            if len(types) > 1:
                return self.fault(path, 'give a "type": the schema has keywords of both arrays and objects')
        if "$ref" in schema:
            self.ref(schema["$ref"], f"{path}.$ref")
        combinator = next((k for k in ("$ref", "anyOf", "oneOf") if k in schema), None)
        if combinator is not None:
            into = "the schema it names" if combinator == "$ref" else "each alternative"
            for key in sorted(keys - {combinator}):
                self.fault(f"{path}.{key}", f"is not enforced beside {combinator}: move it into {into}")
            return
        if "enum" in schema or "const" in schema:
            return self.values(schema, path, types, keys)
        for key in sorted(keys):
            of = _OF_TYPE.get(key)
            if "type" not in schema and of is not None and not (types & ({of, "integer"} if of == "number" else {of})):
                need = '"integer" or "number"' if of == "number" else f'"{of}"'
                self.fault(f"{path}.{key}", f'is not enforced without "type": {need}')
        self.numbers(schema, path, types)
        if "string" in types:
            self.strings(schema, path)
        if "object" in types and "required" in schema:
            self.required(schema, path)

    def ref(self, ref, path: str) -> None:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return self.fault(
                path, 'only a reference within the schema ("#" or "#/...") is followed, not ' + json.dumps(ref)
            )
        target = _resolve(self.root, ref)
        if not isinstance(target, dict | bool):
            self.fault(path, f"{json.dumps(ref)} points to no schema")

    def values(self, schema: dict, path: str, types: set[str], keys: set[str]) -> None:
        """enum and const: xgrammar writes their values as given, and drops any other keyword beside them."""
        for key in sorted(keys - {"enum", "const", "type"}):
            self.fault(f"{path}.{key}", "is not enforced beside enum or const")
        if "enum" in schema and "const" in schema:
            self.fault(f"{path}.enum", "is not enforced beside const")
        values = [(f"{path}.const", schema["const"])] if "const" in schema else []
        if "enum" in schema:
            enum = schema["enum"]
            if not isinstance(enum, list) or not enum:
                return self.fault(f"{path}.enum", "must be a non-empty list")
            values += [(f"{path}.enum[{i}]", v) for i, v in enumerate(enum)]
        for at, value in values:
            if "type" in schema and not _fits(value, types):
                self.fault(at, f"{json.dumps(value)[:40]} is not of the schema's type {json.dumps(schema['type'])}")

    def numbers(self, schema: dict, path: str, types: set[str]) -> None:
        for key in _COUNTS:
            v = schema.get(key)
            if key in schema and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_COUNT):
                self.fault(f"{path}.{key}", f"must be a whole number from 0 to {_MAX_COUNT}, not {json.dumps(v)}")
        for low, high in (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties")):
            a, b = schema.get(low), schema.get(high)
            if _is_number(a) and _is_number(b) and a > b:
                self.fault(path, f"{low} {a} is above {high} {b}")
        whole = "integer" in types and "number" not in types
        for key in (*_BOUNDS, "multipleOf"):
            if key in schema and not _is_number(schema[key]):
                self.fault(f"{path}.{key}", f"must be a number, not {json.dumps(schema[key])}")
            elif key in _BOUNDS and key in schema and whole and not float(schema[key]).is_integer():
                self.fault(f"{path}.{key}", f"must be a whole number for type integer, not {schema[key]}")
        bounds = {k: schema[k] for k in _BOUNDS if _is_number(schema.get(k))}
        lows = [(bounds[k], k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if k in bounds]
        highs = [(bounds[k], k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if k in bounds]
        if whole:  # as inclusive whole bounds
            lows = [(math.floor(v) + 1 if strict else math.ceil(v), False) for v, strict in lows]
            highs = [(math.ceil(v) - 1 if strict else math.floor(v), False) for v, strict in highs]
        if lows and highs:
            (lo, lo_strict), (hi, hi_strict) = max(lows), min(highs, key=lambda b: (b[0], not b[1]))
            if lo > hi or (lo == hi and (lo_strict or hi_strict)):
                within = ", ".join(f"{k} {v}" for k, v in bounds.items())
                self.fault(path, f"no {'integer' if whole else 'number'} lies within {within}")
        m = schema.get("multipleOf")
        if _is_number(m):
            if m <= 0:
                self.fault(f"{path}.multipleOf", f"must be above 0, not {m}")
            elif not float(m).is_integer() or "number" in types:
                self.fault(f"{path}.multipleOf", 'is enforced only as a whole number on "type": "integer"')

    def strings(self, schema: dict, path: str) -> None:
        if "pattern" in schema:
            pattern = schema["pattern"]
            problem = regex_fault(pattern) if isinstance(pattern, str) else "must be a string"
            if problem:
                self.fault(f"{path}.pattern", problem)
        if "format" in schema:
            fmt = schema["format"]
            if not isinstance(fmt, str) or fmt not in _FORMATS | _HINT_FORMATS:
                known = ", ".join(sorted(_FORMATS))
                self.fault(f"{path}.format", f"{json.dumps(fmt)} is not enforced; the formats that are: {known}")

    def required(self, schema: dict, path: str) -> None:
        required, properties = schema["required"], schema.get("properties", {})
        if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
            return self.fault(f"{path}.required", "must be a list of property names")
        missing = [r for r in required if not isinstance(properties, dict) or r not in properties]
        if missing:
            names = ", ".join(json.dumps(r) for r in missing[:5])
            self.fault(
                f"{path}.required",
                f"{names} {'is' if len(missing) == 1 else 'are'} not in properties: a required property must be defined there",
            )


def check_schema(schema, path: str = "$") -> _SchemaCheck:
    """Walk a JSON schema once: what structured output cannot enforce, and what it would let pass silently."""
    check = _SchemaCheck(schema)
    try:
        check.walk(schema, path)
    except RecursionError:
        raise InvalidRequestError("the JSON schema is nested too deeply for structured output", "json_schema") from None
    return check


def unenforced_keywords(schema, path: str = "$") -> list[str]:
    """Where a JSON schema uses a keyword structured output cannot enforce, as 'keyword at path'."""
    return check_schema(schema, path).unenforced


# Regex escapes xgrammar reads as ECMA-262 does (JSON schema's dialect); any other letter it matches as itself
# (\Z, \A, \z ...: a warning on its stderr, and the letter in the output). \b, \B, \k, \p and \P it refuses.
_REGEX_ESCAPES = set("dDwWsSnrtfvxuc")
_REPEAT = re.compile(r"\{(\d+)(,(\d*))?\}")


def _escape_fault(letter: str) -> str | None:
    if letter.isascii() and letter.isalpha() and letter not in _REGEX_ESCAPES:
        return f"the escape \\{letter} is not supported (it would match the letter {letter})"
    return None


def regex_fault(pattern: str) -> str | None:
    """Why a regex cannot constrain output as written, or None. xgrammar's converter (guided_regex's, so that a
    JSON schema's pattern and guided_regex agree) refuses look-around, backreferences, flags and what it cannot
    parse; what it accepts but would drop is found here: an escape it does not know, and an anchor (^, $) where it
    is not implied by matching the whole output (`x$y`, `a|b(^c)`, `(^a)*`), which it ignores."""
    try:
        xgr.Grammar.from_regex(pattern)
    except Exception as e:
        return first_line(e)
    tokens: list[str] = []  # "a" (something matched), "(", ")", "|", "^", "$", "*" (a repeat), "?" (an option)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            if problem := _escape_fault(pattern[i + 1 : i + 2]):
                return problem
            tokens.append("a")
            i += 2
        elif c == "[":  # a class, up to its closing ]
            i += 1
            while i < n and pattern[i] != "]":
                if pattern[i] == "\\" and (problem := _escape_fault(pattern[i + 1 : i + 2])):
                    return problem
                i += 2 if pattern[i] == "\\" else 1
            tokens.append("a")
            i += 1
        elif c == "(":
            tokens.append("(")
            i += 1
            if pattern.startswith("?:", i):
                i += 2
            elif pattern.startswith("?<", i):
                i = pattern.find(">", i) + 1 or n
        elif c in ")|^$":
            tokens.append(c)
            i += 1
        elif c in "*+?":
            tokens.append("?" if c == "?" else "*")
            i += 1
        elif (m := _REPEAT.match(pattern, i)) is not None:
            at_most = m.group(1) if m.group(2) is None else m.group(3)
            tokens.append("*" if at_most == "" or int(at_most) > 1 else "?")
            i = m.end()
        else:
            tokens.append("a")
            i += 1
    for anchor, opening, closing, order in (("^", "(", ")", tokens), ("$", ")", "(", tokens[::-1])):
        groups = [[True, True]]  # per open group: nothing can come before it; nothing matched yet in its branch
        for t in order:
            if t == opening:
                groups.append([groups[-1][0] and groups[-1][1], True])
            elif t == closing:
                if len(groups) > 1:
                    groups.pop()
                groups[-1][1] = False
            elif t == "|":
                groups[-1][1] = True
            elif t == anchor and not (groups[-1][0] and groups[-1][1]):
                return f"the anchor {anchor} inside the regex is not supported (only at its start or end)"
            elif t == "a":
                groups[-1][1] = False
    opened: list[int] = []
    for k, t in enumerate(tokens):  # a repeated group with an anchor in it: (^a)+
        if t == "(":
            opened.append(k)
        elif t == ")" and opened:
            start = opened.pop()
            if tokens[k + 1 : k + 2] == ["*"] and {"^", "$"} & set(tokens[start:k]):
                return "an anchor (^, $) inside a repeated group is not supported"
    return None


# How deeply a JSON schema (or structural tag) may nest, in JSON levels: xgrammar builds a grammar in time cubic in
# the depth (300 levels of arrays took 1.2 s, on the server's event loop), and real schemas nest a few levels
# (OpenAI's structured outputs take 5 levels of objects; pydantic nests through $defs, not inline)
MAX_SPEC_DEPTH = 64
# specs already found valid, by their key: the frontend checks a spec twice (the request's field, then the engine
# client's check) and clients send the same schemas over and over
_VALID_SPECS: OrderedDict[tuple, None] = OrderedDict()
_VALID_SPECS_MAX = 1024
_valid_lock = threading.Lock()


def _json_depth(value) -> int:
    """The JSON levels of `value`, counted up to MAX_SPEC_DEPTH + 1."""
    depth, level = 0, [value] if isinstance(value, dict | list) else []
    while level and depth <= MAX_SPEC_DEPTH:
        depth += 1
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x) if isinstance(v, dict | list)]
    return depth


def _check_depth(value, param: str) -> None:
    if _json_depth(value) > MAX_SPEC_DEPTH:
        raise InvalidRequestError(
            f"the {param} is nested too deeply: structured output takes up to {MAX_SPEC_DEPTH} levels of JSON",
            param=param,
        )


def validate(spec: StructuredOutputsParams) -> None:
    """Refuse, with a 400 naming the problem, a spec that does not parse or that xgrammar cannot support.
    Needs no tokenizer: building the grammar catches what compiling it would."""
    key = _spec_key(spec)
    with _valid_lock:
        if key in _VALID_SPECS:
            _VALID_SPECS.move_to_end(key)
            return
    _validate(spec)
    with _valid_lock:
        _VALID_SPECS[key] = None
        if len(_VALID_SPECS) > _VALID_SPECS_MAX:
            _VALID_SPECS.popitem(last=False)


def _validate(spec: StructuredOutputsParams) -> None:
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
            _check_depth(schema, "json_schema")
            _refuse_faults(check_schema(schema))
            xgr.Grammar.from_json_schema(spec.json, any_whitespace=not spec.disable_any_whitespace)
        elif kind == "regex":
            if problem := regex_fault(spec.regex):
                raise InvalidRequestError(f"the regex cannot be used for structured output: {problem}", "regex")
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_choice_ebnf(spec.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec.grammar)
        elif kind == "structural_tag":
            tag = _parse_json(spec.structural_tag, "structural_tag")
            _check_depth(tag, "structural_tag")
            for path, schema in _tag_schemas(tag, "$"):
                _refuse_faults(check_schema(schema, path), "the structural tag's JSON schema", "structural_tag")
            xgr.Grammar.from_structural_tag(spec.structural_tag)
    except InvalidRequestError:
        raise
    except RecursionError:
        raise InvalidRequestError(f"the {kind} spec is nested too deeply for structured output", kind) from None
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types with a readable message
        what = {"json": "JSON schema", "grammar": "EBNF grammar", "structural_tag": "structural tag"}.get(kind, kind)
        raise InvalidRequestError(f"the {what} cannot be used for structured output: {first_line(e)}", kind) from None


def _refuse_faults(check: _SchemaCheck, what: str = "the JSON schema", param: str = "json_schema") -> None:
    if check.unenforced:
        raise InvalidRequestError(
            f"{what} uses what structured output cannot enforce: {', '.join(check.unenforced[:5])}", param
        )
    if check.faults:
        more = f" (and {len(check.faults) - 3} more)" if len(check.faults) > 3 else ""
        raise InvalidRequestError(
            f"{what} cannot be used for structured output: {'; '.join(check.faults[:3])}{more}", param
        )


def _tag_schemas(tag, path: str):
    """The JSON schemas in a structural tag ({"type": "json_schema", "json_schema": ...}), with their paths."""
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and isinstance(tag.get("json_schema"), dict | bool):
            yield f"{path}.json_schema", tag["json_schema"]
            return
        for key, value in tag.items():
            yield from _tag_schemas(value, f"{path}.{key}")
    elif isinstance(tag, list):
        for i, value in enumerate(tag):
            yield from _tag_schemas(value, f"{path}[{i}]")


# xgrammar prefixes its messages with a time and its own source location ("[08:32:28] /project/cpp/x.cc:94: "):
# nothing a client can act on, and nothing to show them
_XGRAMMAR_PREFIX = re.compile(r"^(\[[0-9:]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?")


def first_line(e: Exception) -> str:
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


def lane_of(spec: StructuredOutputsParams) -> str:
    """The lane a spec compiles on: "large" above LARGE_SPEC_BYTES, so that small ones never wait behind it."""
    return "large" if spec_bytes(spec) > LARGE_SPEC_BYTES else "small"


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
    """A spec compiled against the compiler's vocabulary (run in a compile worker: compile_worker.py)."""
    kind = spec.kind
    any_ws = not spec.disable_any_whitespace
    if kind == "json":
        return compiler.compile_json_schema(spec.json, any_whitespace=any_ws, max_whitespace_cnt=max_whitespace(spec))
    if kind == "json_object":
        # any object (xgrammar's builtin JSON grammar also takes arrays and scalars, and any whitespace)
        return compiler.compile_json_schema(ANY_OBJECT, any_whitespace=any_ws, max_whitespace_cnt=max_whitespace(spec))
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        return compiler.compile_grammar(_choice_ebnf(spec.choice))
    if kind == "grammar":
        return compiler.compile_grammar(spec.grammar)
    return compiler.compile_structural_tag(spec.structural_tag)


def _spec_key(spec: StructuredOutputsParams) -> tuple:
    return (spec.kind, spec.json, spec.regex, spec.grammar, spec.structural_tag, tuple(spec.choice or ()),
            spec.disable_any_whitespace)  # fmt: skip


class StructuredOutputs:
    """The engine core's grammar compiler for one model: the tokenizer's vocabulary is read on first use (a
    server that never sees a grammar never pays for it).

    Compiles run in two worker processes (compile_worker.py), each fed by a thread of the core: large specs on
    one lane, the rest on the other, so that no number of slow grammars holds a small one behind them. A request
    that ends or times out while its grammar compiles stops that compile (`abandon`), and a compile that needs
    more memory than --grammar-compile-memory fails with that limit named. Compiled grammars are kept, by spec, up
    to GRAMMAR_CACHE_BYTES."""

    def __init__(self, tokenizer_path: str | Path, vocab_size: int, eos_token_ids: list[int], threads: int = 1):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._info: xgr.TokenizerInfo | None = None
        self._info_lock = threading.Lock()
        self._lanes: dict[str, CompileLane] = {}
        self._pools = {
            "small": ThreadPoolExecutor(max_workers=1, thread_name_prefix="fulcrum-grammar"),
            "large": ThreadPoolExecutor(max_workers=1, thread_name_prefix="fulcrum-grammar-large"),
        }
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads) if threads > 1 else None
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._cache_lock = threading.Lock()
        self._refused: OrderedDict[tuple, str] = OrderedDict()
        self.compile_seconds: list[float] = []  # per compile, for the log and the closing figures

    def tokenizer_info(self) -> xgr.TokenizerInfo:
        with self._info_lock:
            if self._info is None:
                from fulcrum.utils.tokenizer import load_tokenizer

                t0 = time.perf_counter()
                self._info = xgr.TokenizerInfo.from_huggingface(
                    load_tokenizer(self.tokenizer_path), vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
                )
                log.info("structured output: vocabulary read in %.2f s", time.perf_counter() - t0)
            return self._info

    def _lane(self, name: str) -> CompileLane:
        info = self.tokenizer_info()
        with self._info_lock:
            if name not in self._lanes:
                self._lanes[name] = CompileLane(
                    info,
                    compile_spec,
                    grammar_memory_bytes(),
                    MAX_COMPILED_GRAMMAR_BYTES,
                )
            return self._lanes[name]

    def compile(self, spec: StructuredOutputsParams, abandoned: threading.Event | None = None) -> xgr.CompiledGrammar:
        """Compile (or find in the cache) on this thread; CompileFailed says why a spec cannot compile."""
        key = _spec_key(spec)
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if key in self._refused:
                self._refused.move_to_end(key)
                raise CompileRefused(self._refused[key])
        t0 = time.perf_counter()
        lane = self._lane(lane_of(spec))
        try:
            text = lane.compile(spec, abandoned or threading.Event())
        except CompileRefused as e:
            with self._cache_lock:
                self._refused[key] = str(e)
                while len(self._refused) > REFUSED_CACHE_SPECS:
                    self._refused.popitem(last=False)
            raise
        compiled = xgr.CompiledGrammar.deserialize_json(text, self.tokenizer_info())
        self.compile_seconds.append(time.perf_counter() - t0)
        self._keep(key, compiled)
        return compiled

    def _keep(self, key: tuple, compiled: xgr.CompiledGrammar) -> None:
        size = compiled.memory_size_bytes
        with self._cache_lock:
            if key in self._cache or size > GRAMMAR_CACHE_BYTES:
                return
            self._cache[key] = compiled
            self._cache_bytes += size
            while self._cache_bytes > GRAMMAR_CACHE_BYTES:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.memory_size_bytes

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """Compile on a lane (by the spec's size); the future's result is a fresh GrammarState. The future carries
        its deadline (`deadline`): the core ends a request whose grammar is not ready by then, and `abandon`s it."""
        pool = self._pools[lane_of(spec)]
        abandoned = threading.Event()
        future = pool.submit(lambda: GrammarState(self.compile(spec, abandoned)))
        future.deadline = time.monotonic() + compile_timeout_s()
        future.abandoned = abandoned
        return future

    @staticmethod
    def abandon(future: Future) -> None:
        """Nobody waits for this compile any more: drop it if queued, stop its worker if running."""
        future.cancel()
        future.abandoned.set()

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
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for lane in self._lanes.values():
            lane.close()
