"""What the load generator sends: sessions of one or more turns, drawn reproducibly from a seed.

A session is one request (random, shared-prefix, long-prefill, jsonl) or one conversation whose
history grows each turn (multi-turn). Prompt lengths are exact token counts when a tokenizer is
at hand, and word counts (about one token per common English word) when it is not.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

WORKLOADS = ("random", "shared-prefix", "long-prefill", "multi-turn", "jsonl")

# Common English words; without a tokenizer, prompts are made of these (each about one token).
WORDS = (  # noqa: SIM905 - a paragraph of words reads better than a list of 170 strings
    "the of and to in is was for that with as on by at from his her they which this be are were had not "
    "but one all their there been has when who will more no if out so said what up its about into than "
    "them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three house water light city river "
    "morning night voice hand eyes heart words place king queen lord friend sword crown letter garden"
).split()


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `256` (fixed), `uniform:128:512` or `normal:256:64` (mean:std)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str | int) -> LengthDist:
        parts = str(text).split(":")
        try:
            if len(parts) == 1:
                dist = cls("fixed", float(parts[0]))
            elif len(parts) == 3 and parts[0] in ("uniform", "normal"):
                dist = cls(parts[0], float(parts[1]), float(parts[2]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad length {text!r}: use N, uniform:LOW:HIGH or normal:MEAN:STD") from None
        if dist.a < 1 or (dist.kind == "uniform" and dist.b < dist.a) or dist.b < 0:
            raise ValueError(f"bad length {text!r}: lengths are >= 1 and LOW <= HIGH")
        return dist

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(rng.integers(int(self.a), int(self.b) + 1))
        return max(1, round(rng.normal(self.a, self.b)))

    def __str__(self) -> str:
        return f"{self.a:g}" if self.kind == "fixed" else f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass
class Session:
    """One request, or one conversation: user turns sent one after another, each with the history."""

    id: int
    user_turns: list[str]
    max_tokens: list[int]
    input_lens: list[int]  # intended prompt tokens of each turn's new text (exact with a tokenizer)
    system: str | None = None
    system_len: int = 0  # intended tokens of the system prompt
    tag: str = ""  # a class of requests reported on its own (long-prefill: "short" / "long")
    turn_tags: list[str] = field(default_factory=list)


@dataclass
class WorkloadSpec:
    name: str = "random"
    input_len: LengthDist = LengthDist("fixed", 256)
    output_len: LengthDist = LengthDist("fixed", 128)
    num_groups: int = 8  # shared-prefix
    prefix_len: int = 1024  # shared-prefix: tokens of each group's system prompt
    long_fraction: float = 0.1  # long-prefill
    long_input_len: LengthDist = LengthDist("fixed", 4096)
    turns: int = 4  # multi-turn
    dataset: str | None = None  # jsonl
    seed: int = 0


class TextMaker:
    """Random text of a given token length: decoded random token ids with a tokenizer, common words without. A
    server's tokenizer (bench/tokens.py) has no vocabulary to draw from here: its text is words, cut to length by
    its tokens."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._ids = None
        if tokenizer is not None and hasattr(tokenizer, "__len__"):
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            self._ids = np.array([i for i in range(len(tokenizer)) if i not in special])

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def make(self, n: int, rng: np.random.Generator) -> str:
        if self.tokenizer is None:
            return " ".join(rng.choice(WORDS, size=n))
        # decoding random ids then encoding the text can merge or split tokens: cut the text's own
        # tokens at n, and a little shorter when the cut text grows again, until it counts n
        if self._ids is not None:
            canonical = self._encode(self.tokenizer.decode(rng.choice(self._ids, size=n + 8).tolist()))
        else:
            source = " ".join(rng.choice(WORDS, size=n + 8))
            while len(canonical := self._encode(source)) < n + 1:  # words of several tokens, or of less than one
                source += " " + " ".join(rng.choice(WORDS, size=n - len(canonical) + 8))
        best, best_gap = "", n
        for cut in range(n, max(n - 6, 0), -1):
            text = self.tokenizer.decode(canonical[:cut])
            gap = abs(self.count(text) - n)
            if gap < best_gap:
                best, best_gap = text, gap
            if gap == 0:
                break
        return best

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, verbose=False)

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self._encode(text))


def check_spec(spec: WorkloadSpec) -> None:
    """ValueError for a synthetic workload's settings that cannot make sessions."""
    if spec.name not in WORKLOADS:
        raise ValueError(f"unknown workload {spec.name!r}; choose from {', '.join(WORKLOADS)}")
    if spec.name == "shared-prefix" and (spec.num_groups < 1 or spec.prefix_len < 1):
        raise ValueError("shared-prefix needs --num-groups >= 1 and --prefix-len >= 1")
    if spec.name == "long-prefill" and not 0 <= spec.long_fraction <= 1:
        raise ValueError("--long-fraction must be between 0 and 1")
    if spec.name == "multi-turn" and spec.turns < 1:
        raise ValueError("--turns must be >= 1")


def sessions(spec: WorkloadSpec, text: TextMaker) -> Iterator[Session]:
    """The endless, reproducible stream of sessions of a workload (the load generator takes what it needs)."""
    rng = np.random.default_rng(spec.seed)
    if spec.name == "jsonl":
        yield from _jsonl(spec, text)
        return
    check_spec(spec)
    prefixes = []
    if spec.name == "shared-prefix":
        prefixes = [text.make(spec.prefix_len, rng) for _ in range(spec.num_groups)]
    for i in itertools.count():
        if spec.name == "multi-turn":
            lens = [spec.input_len.sample(rng) for _ in range(spec.turns)]
            outs = [spec.output_len.sample(rng) for _ in range(spec.turns)]
            turns = [text.make(n, rng) for n in lens]
            yield Session(i, turns, outs, lens, turn_tags=[f"turn {k + 1}" for k in range(spec.turns)])
            continue
        tag, system, system_len, dist = "", None, 0, spec.input_len
        if spec.name == "long-prefill":
            tag = "long" if rng.random() < spec.long_fraction else "short"
            dist = spec.long_input_len if tag == "long" else spec.input_len
        elif spec.name == "shared-prefix":
            system, system_len = prefixes[i % spec.num_groups], spec.prefix_len
        n = dist.sample(rng)
        turn, max_tokens = text.make(n, rng), spec.output_len.sample(rng)
        yield Session(i, [turn], [max_tokens], [n], system=system, system_len=system_len, tag=tag)


def _jsonl(spec: WorkloadSpec, text: TextMaker) -> Iterator[Session]:
    """Your own prompts, one JSON object a line: `{"prompt": ..., "max_tokens": N}`, or a ShareGPT-style
    conversation (`conversations` with from/value, or `messages` with role/content) whose first user
    turn is the prompt and whose first reply sets the output length. The file is replayed in a loop, each
    pass in an order drawn from the seed (so the points of a sweep do not repeat each other's prompts)."""
    if not spec.dataset:
        raise ValueError("the jsonl workload needs --dataset FILE")
    path = Path(spec.dataset)
    if not path.exists():
        raise ValueError(f"dataset {path} not found")
    items = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(_jsonl_item(json.loads(line), spec, text))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
    items = [it for it in items if it is not None]
    if not items:
        raise ValueError(f"{path} has no usable prompts")
    rng = np.random.default_rng(spec.seed)
    counts = [text.count(prompt) for prompt, _ in items]
    i = 0
    while True:
        for j in rng.permutation(len(items)):
            prompt, max_tokens = items[j]
            yield Session(i, [prompt], [max_tokens], [counts[j]])
            i += 1


def _jsonl_item(obj: dict, spec: WorkloadSpec, text: TextMaker) -> tuple[str, int] | None:
    if not isinstance(obj, dict):
        raise ValueError(f"each line must be a JSON object, not {_json_kind(obj)}")
    if "prompt" in obj:
        return str(obj["prompt"]), int(obj.get("max_tokens") or spec.output_len.a)
    turns = obj.get("conversations") or obj.get("messages")
    if not isinstance(turns, list):
        raise ValueError('each line needs "prompt", "conversations" or "messages"')
    if not all(isinstance(t, dict) for t in turns):
        raise ValueError("each turn of a conversation must be a JSON object with from/value or role/content")
    pairs = [(t.get("from") or t.get("role"), t.get("value") or t.get("content") or "") for t in turns]
    users = [i for i, (who, _) in enumerate(pairs) if who in ("human", "user")]
    if not users:
        return None  # a conversation without a user turn has nothing to send
    first = users[0]
    reply = next((c for who, c in pairs[first + 1 :] if who in ("gpt", "assistant")), None)
    max_tokens = max(1, text.count(reply)) if reply else int(spec.output_len.a)
    return pairs[first][1], max_tokens


def _json_kind(value) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
