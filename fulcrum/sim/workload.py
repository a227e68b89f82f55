"""The simulated load: bench serve's workloads as token ids, and the arrival times of an open or closed loop.

The synthetic workloads draw their lengths from the same distributions as `fulcrum bench serve` (WorkloadSpec, the
same seed) and their tokens straight as ids (no text to make and tokenize: a run of 100,000 requests starts at
once). A shared-prefix group's system prompt is the same ids in every session of the group, so prefix caching and
prefix-aware routing see exactly what they see live. A jsonl trace is bench's format (prompt and max_tokens, or
ShareGPT conversations), tokenized with the model's tokenizer when there is one (word ids otherwise), and may carry
its own arrival times (`timestamp` or `arrival_time`, seconds: then it is replayed on that clock) and a `priority`
per request (lower runs first, as the engine's priority scheduling takes it)."""

from __future__ import annotations

import itertools
import json
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fulcrum.bench.workloads import TextMaker, WorkloadSpec, _jsonl_item, check_spec


@dataclass
class SimSession:
    """One request, or a conversation whose turns go one after another, each prompt the history so far (the
    earlier prompts and the replies the engine generated) and the new user tokens."""

    id: int
    system: list[int]  # ids shared by the sessions of a group (shared-prefix), else empty
    turns: list[list[int]]  # the new user tokens of each turn
    max_tokens: list[int]
    tag: str = ""
    turn_tags: list[str] = field(default_factory=list)
    arrival: float | None = None  # a trace's own arrival time (seconds from its start)
    priority: int = 0  # a trace's `priority` (lower runs first, as the engine takes it)


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, size=n).tolist()


def token_sessions(spec: WorkloadSpec, vocab: int, encode: Callable[[str], list[int]] | None = None,
                   ) -> Iterator[SimSession]:  # fmt: skip
    """The endless, reproducible stream of a workload's sessions as token ids. `encode` turns a jsonl trace's text
    into ids (the model's tokenizer; word ids without one)."""
    if spec.name == "jsonl":
        yield from trace_sessions(spec, encode or word_ids(vocab))
        return
    check_spec(spec)
    rng = np.random.default_rng(spec.seed)
    prefixes: list[list[int]] = []
    if spec.name == "shared-prefix":
        prefixes = [_ids(rng, spec.prefix_len, vocab) for _ in range(spec.num_groups)]
    for i in itertools.count():
        if spec.name == "multi-turn":
            lens = [spec.input_len.sample(rng) for _ in range(spec.turns)]
            outs = [spec.output_len.sample(rng) for _ in range(spec.turns)]
            turns = [_ids(rng, n, vocab) for n in lens]
            yield SimSession(i, [], turns, outs, turn_tags=[f"turn {k + 1}" for k in range(spec.turns)])
            continue
        tag, system, dist = "", [], spec.input_len
        if spec.name == "long-prefill":
            tag = "long" if rng.random() < spec.long_fraction else "short"
            dist = spec.long_input_len if tag == "long" else spec.input_len
        elif spec.name == "shared-prefix":
            system = prefixes[i % spec.num_groups]
        n = dist.sample(rng)
        yield SimSession(i, system, [_ids(rng, n, vocab)], [spec.output_len.sample(rng)], tag=tag)


def word_ids(vocab: int) -> Callable[[str], list[int]]:
    """Text to ids without a tokenizer: one id per word (bench counts a word as a token then), the same word the
    same id, so that prompts sharing text share ids."""
    return lambda text: [zlib.crc32(w.encode()) % vocab for w in text.split()]


def trace_sessions(spec: WorkloadSpec, encode: Callable[[str], list[int]]) -> Iterator[SimSession]:
    """A jsonl trace: bench's prompt/max_tokens or conversation lines, each optionally with `timestamp` (or
    `arrival_time`) in seconds. Lines with arrival times are replayed once, in time order; lines without are
    replayed in a loop as bench does (each pass in an order drawn from the seed). Errors name the line."""
    if not spec.dataset:
        raise ValueError("the jsonl workload needs --dataset FILE")
    path = Path(spec.dataset)
    if not path.is_file():
        raise ValueError(f"dataset {path} not found")
    counter = TextMaker(None)
    items: list[tuple[list[int], int, float | None]] = []
    timed = None
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            item = _jsonl_item(obj, spec, counter)
            if item is None:
                continue
            priority = obj.get("priority", 0)
            if isinstance(priority, bool) or not isinstance(priority, int):
                raise ValueError(f"priority must be an integer, not {priority!r}")
            at = obj.get("timestamp", obj.get("arrival_time"))
            if at is not None and (isinstance(at, bool) or not isinstance(at, (int, float)) or at < 0
                                   or not math.isfinite(at)):  # fmt: skip
                raise ValueError(f"timestamp must be a number of seconds >= 0, not {at!r}")
            if timed is None:
                timed = at is not None
            elif timed != (at is not None):
                raise ValueError("either every line has a timestamp or none does")
            prompt, max_tokens = item
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, not {max_tokens}")
            ids = encode(prompt)
            if not ids:
                raise ValueError("the prompt is empty")
            items.append((ids, max_tokens, float(at) if at is not None else None, priority))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
    if not items:
        raise ValueError(f"{path} has no usable prompts")
    if timed:
        items.sort(key=lambda it: it[2])
        for i, (ids, max_tokens, at, priority) in enumerate(items):
            yield SimSession(i, [], [ids], [max_tokens], arrival=at - items[0][2], priority=priority)
        return
    rng = np.random.default_rng(spec.seed)
    i = 0
    while True:
        for j in rng.permutation(len(items)):
            ids, max_tokens, _, priority = items[j]
            yield SimSession(i, [], [ids], [max_tokens], priority=priority)
            i += 1


def arrivals(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Open-loop arrival times from 0: gamma gaps with mean 1/rate and shape `burstiness` (1: Poisson), as bench's
    load generator draws them."""
    rng = np.random.default_rng(seed)
    t = 0.0
    while True:
        yield t
        t += 0.0 if math.isinf(rate) else float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
