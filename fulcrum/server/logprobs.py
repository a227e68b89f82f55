"""Logprobs in OpenAI's two shapes: the completions one (parallel lists with text offsets) and the chat
one (an entry per token with its bytes and top alternatives); and the prompt's, in vLLM's shape
(`prompt_logprobs`) or as the echoed part of the completions one."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from fulcrum.protocol import ChatChoiceLogprobs, ChatLogprobEntry, CompletionLogprobs

# A token the request's grammar, min_tokens or a ban ruled out has logprob -inf, which JSON cannot carry: it is sent
# as this floor, as vLLM sends it
LOGPROB_FLOOR = -9999.0


def finite(v: float | None) -> float | None:
    return v if v is None or v >= LOGPROB_FLOOR else LOGPROB_FLOOR


def top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one step (an entry holds the sampled token and the top k)."""
    return [(t, finite(v)) for t, v in sorted(entry.items(), key=lambda kv: -kv[1])[:k]]


def completion_logprobs(
    tok: PreTrainedTokenizerBase, token_ids: list[int], logprobs, start_offset: int, k: int
) -> CompletionLogprobs:
    lp = CompletionLogprobs()
    offset = start_offset
    for tid, entry in zip(token_ids, logprobs or []):
        s = tok.decode([tid])
        lp.tokens.append(s)
        lp.token_logprobs.append(finite(entry.get(tid)))
        lp.top_logprobs.append({tok.decode([t]): v for t, v in top(entry, k)} or None)
        lp.text_offset.append(offset)
        offset += len(s)
    return lp


def chat_logprobs(tok: PreTrainedTokenizerBase, token_ids: list[int], logprobs, k: int) -> ChatChoiceLogprobs:
    content = []
    for tid, entry in zip(token_ids, logprobs or []):
        s = tok.decode([tid])
        alternatives = []
        for t, v in top(entry, k):
            text = tok.decode([t])
            alternatives.append({"token": text, "logprob": v, "bytes": list(text.encode())})
        content.append(
            ChatLogprobEntry(token=s, logprob=finite(entry.get(tid)), bytes=list(s.encode()), top_logprobs=alternatives)
        )
    return ChatChoiceLogprobs(content=content)


def prompt_logprobs(tok: PreTrainedTokenizerBase, entries) -> list | None:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): {"logprob": finite(lp), "rank": rank, "decoded_token": tok.decode([t])}
            for t, (lp, rank) in e.items()
        }
        for e in entries
    ]


def echo_logprobs(tok: PreTrainedTokenizerBase, prompt_ids: list[int], entries, k: int) -> CompletionLogprobs:
    """The echoed prompt's part of completions logprobs: its first token has none (null), as in vLLM."""
    first = tok.decode([prompt_ids[0]])
    rest = [{t: lp for t, (lp, _) in e.items()} for e in (entries or [None])[1:]]
    lp = completion_logprobs(tok, prompt_ids[1:], rest, len(first), k)
    return CompletionLogprobs(
        text_offset=[0, *lp.text_offset],
        token_logprobs=[None, *lp.token_logprobs],
        tokens=[first, *lp.tokens],
        top_logprobs=[None, *lp.top_logprobs],
    )


def joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=a.text_offset + b.text_offset,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        tokens=a.tokens + b.tokens,
        top_logprobs=a.top_logprobs + b.top_logprobs,
    )
