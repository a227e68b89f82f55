"""POST /v1/completions: one or more prompts, n samples each, streamed or whole."""

from __future__ import annotations

from fastapi import Request

from fulcrum.engine.prompts import tokenize_prompts
from fulcrum.errors import InvalidRequestError
from fulcrum.protocol import CompletionChoice, CompletionRequest, CompletionResponse, random_id
from fulcrum.server.logprobs import completion_logprobs
from fulcrum.server.state import ServerState, sampling_params
from fulcrum.server.streaming import Run, merged, usage_of


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    state.check_model(req.model)
    if req.best_of not in (None, req.n):
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    if req.suffix:
        raise InvalidRequestError("suffix (fill-in-the-middle) is not supported", param="suffix")
    tok = state.engine.tokenizer
    prompts = tokenize_prompts(req.prompt, tok)
    params = sampling_params(req, req.max_tokens, req.logprobs)
    run = await Run.start(merged(state.engine, prompts, params, req.priority))
    echo = [(p if p is not None else tok.decode(ids)) if req.echo else "" for p, ids in prompts]
    rid, n, k = random_id("cmpl"), req.n, req.logprobs

    def response(choices, usage=None) -> CompletionResponse:
        return CompletionResponse(id=rid, model=state.model_name, choices=choices, usage=usage)

    if req.stream:

        async def events():
            sent: dict[int, int] = {}  # choice index -> tokens already streamed
            finished = {}  # prompt index -> its final output
            async for i, ro, deltas in run.items():
                for j, delta in deltas.items():
                    out, idx = ro.outputs[j], i * n + j
                    done = sent.get(idx)
                    lp = None
                    if k is not None:
                        lp = completion_logprobs(tok, out.token_ids[done or 0 :], out.logprobs[done or 0 :], 0, k)
                    sent[idx] = len(out.token_ids)
                    text = delta if done is not None else echo[i] + delta
                    choice = CompletionChoice(
                        index=idx, text=text, logprobs=lp, finish_reason=out.finish_reason, stop_reason=out.stop_reason
                    )
                    yield response([choice])
                if ro.finished:
                    finished[i] = ro
            if req.stream_options and req.stream_options.include_usage:
                yield response([], usage_of(finished.values()))

        return run.stream(events())

    last = await run.collect(request)
    if not isinstance(last, dict):
        return last  # the client went away
    choices = []
    for i in range(len(prompts)):
        for j, out in enumerate(last[i].outputs):
            lp = completion_logprobs(tok, out.token_ids, out.logprobs, len(echo[i]), k) if k is not None else None
            choices.append(
                CompletionChoice(
                    index=i * n + j,
                    text=echo[i] + out.text,
                    logprobs=lp,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                )
            )
    return response(choices, usage_of(last.values()))
