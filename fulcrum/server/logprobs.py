"""Logprobs in OpenAI's two shapes: the completions one (parallel lists with text offsets) and the chat
one (an entry per token with its bytes and top alternatives)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from fulcrum.protocol import ChatChoiceLogprobs, ChatLogprobEntry, CompletionLogprobs


def top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one step (an entry holds the sampled token and the top k)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(
    tok: PreTrainedTokenizerBase, token_ids: list[int], logprobs, start_offset: int, k: int
) -> CompletionLogprobs:
    lp = CompletionLogprobs()
    offset = start_offset
    for tid, entry in zip(token_ids, logprobs or []):
        s = tok.decode([tid])
        lp.tokens.append(s)
        lp.token_logprobs.append(entry.get(tid))
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
            ChatLogprobEntry(token=s, logprob=entry.get(tid), bytes=list(s.encode()), top_logprobs=alternatives)
        )
    return ChatChoiceLogprobs(content=content)
