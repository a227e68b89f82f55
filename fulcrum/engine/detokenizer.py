"""Incremental detokenization with stop strings.

Each step costs O(1): a fast (Rust) tokenizer decodes through `tokenizers`' DecodeStream, as vLLM does (measured:
benchmarks/results/cpu-detokenizer.log); any other tokenizer decodes a short window of recent tokens. A character
whose bytes are split across tokens, and text that might start a stop string, are held back until settled."""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# tokens of left context kept so that decoding a window joins words the way a full decode does
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        """`min_tokens`: stop strings are looked for only once this many output tokens are read (as vLLM checks them),
        so a request asking for at least N tokens is not cut short by a stop string among its first ones."""
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.num_read = 0  # output tokens read so far
        self.skip_special = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        # token_ids[prefix_offset:read_offset] is the context of the text not yet out, which starts at read_offset
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        self.streamed = 0  # characters of output_text already handed out
        self.taken = 0  # tokens of the last add_tokens read: all of them, or up to the one that completed a stop
        # DecodeStream keeps its own window in Rust: one call per token instead of two full decodes in Python
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        # A context that decodes to a replacement character (a prompt cut mid-character, or one holding U+FFFD)
        # is taken by DecodeStream as not yet emitted, and it would hand out the prompt's tail as new text:
        # the window decode takes those requests.
        clean = self.backend is not None and "\ufffd" not in self._decode(self.token_ids)
        self.stream = DecodeStream(ids=list(self.token_ids), skip_special_tokens=skip_special_tokens) if clean else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def _stream_step(self, tid: int) -> str | None:
        try:
            return self.stream.step(self.backend, tid)
        except Exception:  # the binding raises a bare Exception
            # "Invalid prefix encountered": a decoder whose text is not monotonic in its tokens (a strip
            # after invalid bytes; vLLM issue 17448) breaks the stream's state. The window decode has no
            # such state, and the offsets it needs are kept up to date: it takes over this request.
            log.debug("DecodeStream failed on token %d; window decode from here on", tid, exc_info=True)
            self.stream = None
            return self._window_step()

    def _window_step(self) -> str | None:
        """The text the last token completes, decoded from the window; None while a character is partial."""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            return full[len(prefix) :]
        return None

    def add_tokens(self, new_ids: list[int]) -> str | None:
        """Append tokens; return the stop string that matched, if any (the text is then final, and the tokens after
        the one that completed it are not read: `taken` counts those that were). A match truncates the output, the
        stop text shown only if asked for. Several tokens come at once under speculative decoding: the caller keeps
        the `taken` ones only (their ids, logprobs and count), as it would have had they come one per step."""
        self.taken = 0
        for tid in new_ids:
            self.taken += 1
            self.num_read += 1
            self.token_ids.append(tid)
            new = self._stream_step(tid) if self.stream is not None else self._window_step()
            if new:
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
                before = len(self.output_text)
                self.output_text += new
                hit = self._find_stop(before, len(new)) if self.num_read >= self.min_tokens else None
                if hit is not None:
                    return hit
        return None

    def _find_stop(self, before: int, added: int) -> str | None:
        for s in self.stop:
            start = max(0, before - len(s) + 1)
            i = self.output_text.find(s, start)
            if i != -1:
                self.output_text = self.output_text[: i + len(s) if self.include_stop else i]
                return s
        return None

    def flush(self) -> str:
        """At the end: whatever is still undecoded (a dangling partial character included)."""
        rest = self._decode(self.token_ids[self.prefix_offset :])
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        if len(rest) > len(prefix):
            self.output_text += rest[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.token_ids)
        return self.output_text

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while streaming, holds back what may start a stop string (the last
        `len(longest stop) - 1` characters)."""
        end = len(self.output_text) if finished else max(self.streamed, len(self.output_text) - self.hold)
        delta = self.output_text[self.streamed : end]
        self.streamed = end
        return delta
