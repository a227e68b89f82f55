"""POST /v1/completions: one or more prompts, n samples each, streamed or whole; with echo and logprobs the
prompt is scored too (max_tokens 0: only scored, as lm-eval-harness asks)."""

from __future__ import annotations

from fastapi import Request

from fulcrum.engine.prompts import tokenize_prompts
from fulcrum.errors import InvalidRequestError
from fulcrum.protocol import CompletionChoice, CompletionRequest, CompletionResponse, random_id
from fulcrum.server.limits import off_loop
from fulcrum.server.logprobs import completion_logprobs, echo_logprobs, joined, prompt_logprobs
from fulcrum.server.stages import StageClock
from fulcrum.server.state import ServerState, sampling_params
from fulcrum.server.streaming import StartedRequest, check_kv_transfer_request, generate_prompts, usage_of


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    clock = StageClock(request, state.metrics.frontend)
    clock.mark("receive")
    lora_name = state.check_model(req.model)
    if req.best_of not in (None, req.n):
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    if req.stream and req.max_tokens == 0:
        raise InvalidRequestError("max_tokens 0 (scoring the prompt) is not supported with stream", "max_tokens")
    tok = state.engine.tokenizer
    prompts = await off_loop(tokenize_prompts, req.prompt, tok)
    clock.mark("tokenize")
    k = req.logprobs
    score_echo = req.echo and k is not None
    wanted = [x for x in (req.prompt_logprobs, k if score_echo else None) if x is not None]
    # max_tokens 0: the engine computes the prompt and one token, which is dropped
    zero = req.max_tokens == 0
    # off the event loop: checking a grammar builds it
    params = await off_loop(sampling_params, req, 1 if zero else req.max_tokens, k, max(wanted) if wanted else None)
    check_kv_transfer_request(req.kv_transfer_params, len(prompts), req.stream)
    clock.mark("params")
    timer = state.metrics.stream_timer(clock.arrival) if req.stream else None
    run = await StartedRequest.start(
        generate_prompts(state.engine, prompts, params, req.priority, req.kv_transfer_params, lora_name, clock.arrival,
                         timer=timer),
        timer,
    )  # fmt: skip
    echo = [(p if p is not None else tok.decode(ids)) if req.echo else "" for p, ids in prompts]
    rid, n = random_id("cmpl"), req.n

    def response(choices, usage=None, kv_transfer_params=None) -> CompletionResponse:
        return CompletionResponse(
            id=rid,
            model=lora_name or state.model_name,
            choices=choices,
            usage=usage,
            kv_transfer_params=kv_transfer_params,
        )

    def echoed(i, ro):
        return echo_logprobs(tok, prompts[i][1], ro.prompt_logprobs, k) if score_echo else None

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
                        if done is None and score_echo:
                            lp = joined(echoed(i, ro), lp)
                    sent[idx] = len(out.token_ids)
                    text = delta if done is not None else echo[i] + delta
                    choice = CompletionChoice(
                        index=idx, text=text, logprobs=lp, finish_reason=out.finish_reason, stop_reason=out.stop_reason
                    )
                    if done is None and req.prompt_logprobs is not None:  # with the choice's first chunk, as vLLM
                        choice.prompt_logprobs = prompt_logprobs(tok, ro.prompt_logprobs)
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
        ro = last[i]
        for j, out in enumerate(ro.outputs):
            if zero:
                out.text, out.token_ids, out.logprobs = "", [], []
                out.finish_reason, out.stop_reason = "length", None
            lp = None
            if k is not None:
                lp = completion_logprobs(tok, out.token_ids, out.logprobs, len(echo[i]), k)
                if score_echo:
                    lp = joined(echoed(i, ro), lp)
            choices.append(
                CompletionChoice(
                    index=i * n + j,
                    text=echo[i] + out.text,
                    logprobs=lp,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    prompt_logprobs=prompt_logprobs(tok, ro.prompt_logprobs)
                    if req.prompt_logprobs is not None
                    else None,
                )
            )
    return response(choices, usage_of(last.values()), last[0].kv_transfer_params)
