"""Reasoning output (`--reasoning-parser`): a reasoning model's thought, written between `<think>` and `</think>`,
split from its answer, streamed or whole. The split is a character-level state machine, so the streamed pieces
joined are the whole answer's split by construction.

- `qwen3`: the model opens the block itself (`<think>` at the start of its output); an output that does not start
  with it has no thought (Qwen3 with `enable_thinking: false`, whose template closes an empty block in the prompt).
- `deepseek_r1`: the chat template opens the block in the prompt, so the output starts inside it (a `<think>` the
  model writes anyway is dropped); what comes before `</think>` is the thought.

Either way a prompt whose rendered text ends inside an open block starts the output inside it, and a block that is
never closed (the answer cut by max_tokens) is all thought.

- `gpt_oss`: OpenAI's harmony format, messages `<|channel|>NAME<|message|>TEXT<|end|>` (the next one opened by
  `<|start|>assistant`, the last closed by `<|return|>` or `<|call|>`): the analysis channel is the thought, the
  final (and commentary) channel the answer; the tags themselves are dropped. Its tags are special tokens, so the
  server keeps special tokens in the text this parser reads (KEEPS_SPECIAL_TOKENS)."""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
_OPENING, _THINKING, _ANSWER = range(3)


@dataclass
class ReasoningDelta:
    reasoning: str | None = None
    content: str | None = None


class ReasoningParser:
    def __init__(self, starts_inside: bool):
        self._state = _THINKING if starts_inside else _OPENING
        self._held = ""  # text that may be the start of a tag
        self._first = True  # nothing of the thought seen yet (a leading <think> is dropped, leading newlines too)
        self._answer_started = False
        self._start_dropped = False

    def feed(self, text: str) -> ReasoningDelta:
        reasoning, content = [], []
        text = self._held + text
        self._held = ""
        while text:
            if self._state == _OPENING:
                stripped = text.lstrip()
                if not stripped:  # only whitespace so far: it may still precede <think>
                    self._held = text
                    break
                if stripped.startswith(START):
                    self._state, text = _THINKING, stripped[len(START) :]
                    self._start_dropped = True
                elif START.startswith(stripped):  # a prefix of <think>: wait for more
                    self._held = text
                    break
                else:
                    self._state = _ANSWER
            elif self._state == _THINKING:
                if self._first:
                    stripped = text.lstrip("\n")
                    if not self._start_dropped:
                        if START.startswith(stripped) and stripped != START:
                            self._held = stripped  # empty, or a prefix of <think>: wait for more
                            break
                        if stripped.startswith(START):  # the model repeats the opening the prompt made
                            stripped = stripped[len(START) :].lstrip("\n")
                            self._start_dropped = True
                    if not stripped:
                        break
                    text, self._first = stripped, False
                    continue
                i = text.find(END)
                if i >= 0:
                    reasoning.append(text[:i])
                    self._state, text = _ANSWER, text[i + len(END) :]
                    continue
                keep = _partial_suffix(text, END)
                reasoning.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            else:
                if not self._answer_started:
                    text = text.lstrip("\n")
                    if not text:
                        break
                    self._answer_started = True
                content.append(text)
                break
        return ReasoningDelta("".join(reasoning) or None, "".join(content) or None)

    def finish(self) -> ReasoningDelta:
        """The end of the output: text held back as a possible tag goes where its state says."""
        held, self._held = self._held, ""
        if not held:
            return ReasoningDelta()
        if self._state == _THINKING:
            return ReasoningDelta(reasoning=held.lstrip("\n") if self._first else held)
        return ReasoningDelta(content=held.lstrip("\n") if not self._answer_started else held)

    def split(self, text: str) -> ReasoningDelta:
        """A whole output: (thought, answer), None where empty."""
        a, b = self.feed(text), self.finish()
        reasoning = (a.reasoning or "") + (b.reasoning or "")
        content = (a.content or "") + (b.content or "")
        return ReasoningDelta(reasoning or None, content or None)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")  # what closes a message's text
HARMONY_MESSAGE = "<|message|>"  # what closes a message's header
HARMONY_REASONING_CHANNELS = ("analysis",)


class HarmonyParser:
    """The harmony split, one message at a time: a header (up to `<|message|>`, its channel after `<|channel|>`),
    then the text up to a closing tag. Text that may be the start of a tag is held until it is told apart. An
    output with no header at all (a model that writes plain text) is all answer."""

    def __init__(self):
        self._in_header = True
        self._channel = None
        self._held = ""  # header text so far, or the message text that may start a tag

    def feed(self, text: str) -> ReasoningDelta:
        reasoning, content = [], []
        text = self._held + text
        self._held = ""
        while text:
            if self._in_header:
                i = text.find(HARMONY_MESSAGE)
                if i >= 0:
                    header, text = text[:i], text[i + len(HARMONY_MESSAGE) :]
                    channel = header.partition("<|channel|>")[2]
                    self._channel = channel.split("<|")[0].split()[0] if channel.strip() else None
                    self._in_header = False
                    continue
                stripped = text.lstrip()
                if stripped and not stripped.startswith("<|") and not "<|".startswith(stripped):
                    self._in_header, self._channel = False, None  # no header: plain text, the answer
                    continue
                self._held = text
                break
            ends = [(i, tag) for tag in HARMONY_ENDS if (i := text.find(tag)) >= 0]
            i, tag = min(ends) if ends else (len(text), "")
            keep = 0 if ends else max(_partial_suffix(text, t) for t in HARMONY_ENDS)
            piece = text[: i - keep] if not ends else text[:i]
            (reasoning if self._channel in HARMONY_REASONING_CHANNELS else content).append(piece)
            if not ends:
                self._held = text[len(text) - keep :] if keep else ""
                break
            # <|start|> opens the next header; the other tags close this message, whose next header follows
            text = text[i:] if tag == "<|start|>" else text[i + len(tag) :]
            self._in_header = True
        return ReasoningDelta("".join(reasoning) or None, "".join(content) or None)

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        if not held or self._in_header:
            return ReasoningDelta()  # an unfinished header or tag is no text
        if self._channel in HARMONY_REASONING_CHANNELS:
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held)

    split = ReasoningParser.split


PARSERS = {"qwen3": False, "deepseek_r1": True, "gpt_oss": None}  # name -> the output starts inside the block
KEEPS_SPECIAL_TOKENS = ("gpt_oss",)  # parsers that read tags the tokenizer holds as special tokens


def make_parser(name: str, prompt_text: str) -> ReasoningParser | HarmonyParser:
    """The parser for one output; `prompt_text` is the rendered prompt's tail (an open block there starts it
    inside)."""
    if name == "gpt_oss":
        return HarmonyParser()
    tail = prompt_text.rstrip()
    opened = tail.rfind(START) > tail.rfind(END)
    return ReasoningParser(PARSERS[name] or opened)
