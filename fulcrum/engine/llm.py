"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`. An LLM holds processes,
threads and, as rank 0 of a parallel engine, this process's torch.distributed group: close() (or a `with` block, or
dropping the last reference) releases them all. One started while another engine holds the group runs its core in a
process of its own (engine/core_client.py), as vLLM's does."""

from __future__ import annotations

import itertools
import logging
import time
import weakref

import msgspec
from tqdm import tqdm

from fulcrum.config import EngineConfig
from fulcrum.distributed import parallel_state
from fulcrum.engine.core import EngineCore
from fulcrum.engine.core_client import SyncCoreClient
from fulcrum.engine.lora import LoRARequest
from fulcrum.engine.messages import AddRequest
from fulcrum.engine.multimodal import ImageInput, ImagePrompts
from fulcrum.engine.output_processor import OutputProcessor
from fulcrum.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from fulcrum.engine.prompts import tokenize_prompts
from fulcrum.engine.request import check_request, check_task, fan_out, resolve_pooling
from fulcrum.engine.spec.stats import acceptance_rate, mean_accepted_length
from fulcrum.errors import EngineClosedError, InvalidRequestError
from fulcrum.models.lora import LoRAError
from fulcrum.sampling_params import DEFAULT_MAX_TOKENS, PoolingParams, SamplingParams
from fulcrum.utils.tokenizer import chat_prompt_ids, load_tokenizer

log = logging.getLogger(__name__)


class LLM:
    _in_place: weakref.ref | None = None  # the parallel LLM whose ranks this process joined, to name it

    def __init__(self, model: str | None = None, **engine_kwargs):
        self.config = EngineConfig(model=model, **engine_kwargs)
        self.core: EngineCore | SyncCoreClient | None = self._start_core()
        # runs once: on close(), when this LLM is garbage-collected, or at the interpreter's exit
        self._finalizer = weakref.finalize(self, self.core.shutdown)
        try:
            self.tokenizer = load_tokenizer(self.core.model_config.path)
        except BaseException:
            self.close()
            raise
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._image_prompter: ImagePrompts | None = None  # built at the first prompt with images

    def _start_core(self) -> EngineCore | SyncCoreClient:
        """The engine core in this process; data parallel's cores, or one whose ranks this process cannot join (the
        layers read one parallel state per process), each in a process of its own behind EngineCore's interface."""
        config = self.config
        if config.data_parallel_size > 1:
            return SyncCoreClient(config)
        if parallel_state.held(config.world_size):
            holder = LLM._in_place() if LLM._in_place is not None else None
            holder = holder if holder is not None and holder.core is not None else None
            log.info(
                "%s holds this process's torch.distributed group: this engine's core runs in a process of its own",
                holder or "another engine (or the caller)",
            )
            return SyncCoreClient(config)
        core = EngineCore(config)
        if config.world_size > 1:
            LLM._in_place = weakref.ref(self)
        return core

    def close(self) -> None:
        """Stop the engine now: its worker or engine-core processes, its grammar compiler's threads, and this
        process's torch.distributed group (so another LLM, of any parallel layout, can start); rank 0's weights and KV
        cache go with the last reference to the engine. Idempotent; a `with` block's end, the garbage collection of
        the LLM and the interpreter's exit do it too. Using the LLM afterwards raises EngineClosedError."""
        self._finalizer()
        self.core = None

    shutdown = close  # the earlier name

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LLM(model={c.model!r}, tensor_parallel_size={c.tensor_parallel_size}, "
            f"pipeline_parallel_size={c.pipeline_parallel_size}, data_parallel_size={c.data_parallel_size}"
            f"{', closed' if getattr(self, 'core', None) is None else ''})"
        )

    def _open_core(self) -> EngineCore | SyncCoreClient:
        if self.core is None:
            raise EngineClosedError(
                "this LLM was closed (close(), shutdown() or the end of its `with` block); build a new LLM"
            )
        return self.core

    # -- request intake ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        images: ImageInput | None = None,
    ) -> str:
        """Queue one prompt (its n samples become n engine requests sharing the prompt's blocks); with
        `lora_request`, run with that adapter (loaded first if it is not yet)."""
        core = self._open_core()
        lora_name = None
        if lora_request is not None:
            lora_name = lora_request.lora_name
            if lora_name not in self.list_loras():
                self.add_lora(lora_request)
        rid = str(next(self._ids))
        check_task(params, core.model_config.task)
        params = check_request(prompt_ids, params, priority, core.max_model_len, core.vocab_size)
        children = fan_out(rid, params)
        if isinstance(core, EngineCore):
            for child_id, child_params in children:
                core.add_request(child_id, prompt_ids, child_params, priority, lora_name=lora_name, images=images)
        else:  # as one message: the core schedules the samples' prefills together, as in this process
            now = time.time()
            core.add_requests(
                [
                    AddRequest(c, list(prompt_ids), cp, priority, now, lora_name=lora_name, images=images)
                    for c, cp in children
                ]
            )
        self.processor.add_request(rid, prompt, list(prompt_ids), params, [c for c, _ in children])
        return rid

    def _image_prompts(self, prompts):
        """Prompts with images (vLLM's {"prompt": ..., "multi_modal_data": {"image": [file bytes]}}) as the
        processor's token ids, and each prompt's ImageInput (None: a prompt without images)."""
        listed = [prompts] if isinstance(prompts, dict) else prompts
        if not isinstance(listed, list) or not any(isinstance(p, dict) and "multi_modal_data" in p for p in listed):
            return prompts, None
        if self._image_prompter is None:
            self._image_prompter = ImagePrompts(self._open_core().model_config, self.tokenizer)
        out, images = [], []
        for p in listed:
            if not (isinstance(p, dict) and "multi_modal_data" in p):
                out.append(p)
                images.append(None)
                continue
            raw = p["multi_modal_data"].get("image", [])
            raw = [raw] if isinstance(raw, bytes) else list(raw)
            text = p.get("prompt", "")
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, image_input = self._image_prompter(ids, raw, "multi_modal_data")
            out.append({"prompt": p.get("prompt"), "prompt_token_ids": ids})
            images.append(image_input)
        return out, images

    # -- LoRA adapters -------------------------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter (PEFT's layout) under its name; a bad adapter raises LoRAError and changes nothing."""
        self._lora_call("load", lora_request.lora_name, str(lora_request.lora_path))

    def remove_lora(self, name: str) -> None:
        """Unload an adapter; refused while a request that names it is queued or running."""
        self._lora_call("unload", name)

    def list_loras(self) -> list[str]:
        return self._lora_call("list")

    def _lora_call(self, op: str, name: str = "", path: str = "") -> list[str]:
        core = self._open_core()
        if isinstance(core, EngineCore):
            return core.lora(op, name, path)
        reply = core.lora(op, name, path)
        if reply.error:
            raise LoRAError(reply.error, reply.param or "lora_path")
        return reply.names

    def abort(self, request_id: str) -> None:
        children = self.processor.abort(request_id)
        if self.core is not None:  # a closed engine runs nothing
            self.core.abort_requests(children)

    # -- running ---------------------------------------------------------------------------------

    def step(self) -> list[tuple[RequestOutput, dict[int, str]]]:
        """One engine step; returns the requests that progressed, with each sample's new text."""
        core = self._open_core()
        results, stop_now = self.processor.process(core.step())
        if stop_now:
            core.finish_requests(stop_now)
        return results

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the adapter every prompt runs with, or one per prompt (None: the base model)."""
        self._open_core()
        prompts, images = self._image_prompts(prompts)
        items = tokenize_prompts(prompts, self.tokenizer)
        images = images or [None] * len(items)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise InvalidRequestError("give one SamplingParams, or one per prompt", param="sampling_params")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(items)
        if len(loras) != len(items):
            raise InvalidRequestError("give one LoRARequest, or one per prompt", param="lora_request")
        order: list[str] = []
        try:
            for i, ((p, ids), sp) in enumerate(zip(items, params)):
                order.append(self.add_request(p, ids, sp, priority[i] if priority else 0, loras[i], images[i]))
        except BaseException:
            for rid in order:  # a bad prompt further down the list leaves none of the earlier ones queued
                self.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="generating", disable=not use_tqdm or len(order) < 2, unit="req")
        try:
            while len(done) < len(order):
                for ro, _ in self.step():
                    if ro.finished:
                        done[ro.request_id] = ro
                        bar.update(1)
        except BaseException:
            for rid in order:
                if rid not in done:
                    self.abort(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in order]

    def embed(
        self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = True
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt from an embedding model (--task embed, or a sentence-transformers folder): its
        final hidden states pooled as the model says (or as `pooling_params` asks), all prompts batched through the
        scheduler like generation's. `pooling_params.dimensions` keeps the leading dimensions of a matryoshka model."""
        mc = self._open_core().model_config
        if mc.task != "embed":
            check_task(SamplingParams(max_tokens=1, pooling=PoolingParams()), mc.task)
        pp = pooling_params or PoolingParams(mc.pooler.pooling_type, mc.pooler.normalize)
        pp = resolve_pooling(mc.pooler, mc.hf_config.hidden_size, pp.pooling_type, pp.normalize, pp.dimensions)
        outs = self.generate(prompts, SamplingParams(max_tokens=1, pooling=pp), use_tqdm=use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding)) for o in outs]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True):
        """Chat replies; without sampling_params as long as `fulcrum generate`'s (a 16-token reply is cut mid-sentence)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if sampling_params is None:
            sampling_params = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
        prompts = [{"prompt_token_ids": chat_prompt_ids(self.tokenizer, m)} for m in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        """The engine's gauges and counters now (KV blocks, prefix cache, preemptions, queue; with speculative
        decoding its counters, their acceptance rate and mean accepted length, and the draft's KV blocks)."""
        s = msgspec.structs.asdict(self._open_core().stats())
        s["spec_acceptance_rate"] = acceptance_rate(s["spec_num_accepted_tokens"], s["spec_num_draft_tokens"])
        s["spec_mean_accepted_length"] = mean_accepted_length(s["spec_num_accepted_tokens"], s["spec_num_drafts"])
        return s
