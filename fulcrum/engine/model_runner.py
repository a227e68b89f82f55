"""The model runner: owns the weights and the KV cache, turns a scheduler step into one forward
over flattened tokens, and samples the next token of every request that reached its end."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from fulcrum.config import EngineConfig, ModelConfig
from fulcrum.engine.scheduler import ScheduledRequest, SchedulerOutput
from fulcrum.engine.structured import StructuredOutputs
from fulcrum.errors import InvalidRequestError, KVCacheTooSmallError
from fulcrum.kernels import cpu_threads, huge_page_empty, move_parameters_to_huge_pages, warm_up
from fulcrum.layers.attention import Attention, AttentionMetadata, attach_kv_cache
from fulcrum.layers.sampler import Sampler, SamplingMetadata
from fulcrum.models.loader import load_model
from fulcrum.quant import describe
from fulcrum.quant import kv as kv_quant

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # per request, per new token: {token_id: logprob} (sampled token first, then the top-k)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # per request wanting prompt logprobs, for the prompt tokens this step's positions predict:
    # {token_id: (logprob, rank)}, the prompt's own token first, then the top-k
    prompt_logprobs: dict[str, list[dict[int, tuple[float, int]]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, own_process: bool = False):
        self.config = engine_config
        self.model_config = model_config
        self.device = torch.device(engine_config.device)
        torch.manual_seed(engine_config.seed)
        self.model = load_model(model_config, self.device)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        log.info(
            "weights: %.1f MiB (%s, quantization %s)",
            self.weight_bytes / 2**20,
            model_config.dtype,
            describe(
                model_config.quantization,
                model_config.quantization_group_size,
                getattr(model_config.hf_config, "quantization_config", None),
            ),
        )
        if self.device.type == "cpu":
            move_parameters_to_huge_pages(self.model)  # a decode step streams them all: fewer TLB misses
        self.vocab_size = model_config.hf_config.vocab_size
        self.block_size = engine_config.block_size
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_format = kv_quant.kv_format(engine_config.kv_cache_dtype)
        self.kv_cache_dtype_name = (
            str(model_config.dtype).removeprefix("torch.")
            if self.kv_format is None
            else (f"{self.kv_format.name} with a scale per token and head")
        )
        # each layer says what a token costs in its cache (k and v per KV head, or MLA's one latent)
        self.bytes_per_block = self.block_size * sum(
            a.kv_bytes_per_token(model_config.dtype, self.kv_format) for a in self.attn_layers
        )
        self.num_blocks = self._num_kv_blocks()
        if self.num_blocks * self.block_size < model_config.max_model_len:
            raise KVCacheTooSmallError(
                f"the KV cache holds {self.num_blocks * self.block_size} tokens, fewer than max_model_len="
                f"{model_config.max_model_len}; give it more memory (kv_cache_memory / gpu_memory_utilization) "
                "or lower max_model_len"
            )
        # On CPU zeroed, faulted in as blocks are first written, on ordinary pages: where THP defrag is "madvise" (a
        # common default) every huge-page fault of a madvised region compacts memory first, and the first
        # writes of fresh blocks cost 4.6x as much (16 x 27.5k tokens of the bundled model: 303 against 66 ms;
        # faulting all 2 GiB up front: 4.3 s), for a decode attention within 4% either way.
        empty = (lambda shape, dtype: huge_page_empty(shape, dtype, huge=False)) if self.device.type == "cpu" else None
        self.kv_cache, self.kv_scales = attach_kv_cache(
            self.attn_layers, self.num_blocks, self.block_size, model_config.dtype, self.kv_format, self.device, empty
        )
        self.sampler = Sampler()
        self.structured: StructuredOutputs | None = None  # the engine core's grammars, for the token bitmask
        # build or load the CPU kernels now, not in the middle of the first request
        warm_up(self.device, quantized=model_config.quantization is not None, quantized_kv=self.kv_format is not None)
        if self.device.type == "cpu":  # after the builds, which would otherwise inherit the pinning
            try:
                threads = cpu_threads.apply(
                    cpu_threads.plan(engine_config.cpu_threads, engine_config.cpu_bind, own_process)
                )
            except ValueError as e:
                raise InvalidRequestError(str(e), param="cpu_bind") from e
            log.info("CPU: %s", threads.describe())

    # -- KV cache size ---------------------------------------------------------------------------

    def _num_kv_blocks(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory // self.bytes_per_block
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_BYTES // self.bytes_per_block
        return self._profile_cuda_blocks()

    @torch.inference_mode()
    def _profile_cuda_blocks(self) -> int:
        """Run the largest step the scheduler can produce, then give the KV cache what is left
        of `gpu_memory_utilization` of the card."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.model_config.max_model_len
        if self.config.enable_chunked_prefill:
            n = min(self.config.max_num_batched_tokens, n)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        hidden = self.model(ids, pos, AttentionMetadata.for_prompts([n]))
        rows = min(self.config.max_num_seqs, n)
        self.model.compute_logits(hidden[:rows]).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        usable = int(total * self.config.gpu_memory_utilization) - peak - max(non_torch, 0)
        log.info("profiled peak %.2f GiB; %.2f GiB left for the KV cache", peak / 2**30, usable / 2**30)
        return max(usable, 0) // self.bytes_per_block

    # -- one step ----------------------------------------------------------------------------------

    def _prepare(self, scheduled: list[ScheduledRequest]):
        bs = self.block_size
        ids, positions, slots = [], [], []
        prefills, prefill_tables = [], []
        decode_idx, decode_tables, decode_ctx = [], [], []
        logits_idx: list[int] = []
        query_lens = []
        t = 0
        for s in scheduled:
            req, n, table = s.request, s.num_new_tokens, s.block_table
            start = req.num_computed_tokens
            ctx = start + n
            ids.extend(req.all_token_ids[start:ctx])
            pos = range(start, ctx)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            query_lens.append(n)
            if n == 1:
                decode_idx.append(t)
                decode_tables.append(table)
                decode_ctx.append(ctx)
            else:
                prefills.append((t, n, ctx, len(prefill_tables)))
                prefill_tables.append(table)
            t += n
            if s.samples:
                logits_idx.append(t - 1)

        dev = self.device

        def table_tensor(tables):
            width = max(len(x) for x in tables)
            return torch.tensor([x + [0] * (width - len(x)) for x in tables], dtype=torch.long, device=dev)

        meta = AttentionMetadata(
            query_lens=query_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            prefills=prefills,
            block_tables=table_tensor(prefill_tables) if prefill_tables else None,
        )
        if decode_idx:
            meta.decode_token_idx = torch.tensor(decode_idx, dtype=torch.long, device=dev)
            meta.decode_block_tables = table_tensor(decode_tables)
            meta.decode_context_lens = torch.tensor(decode_ctx, dtype=torch.long, device=dev)
            meta.decode_max_context = max(decode_ctx)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        return input_ids, pos_t, meta, logits_idx

    def _sampling_metadata(self, rows: list[ScheduledRequest]) -> SamplingMetadata:
        dev, V = self.device, self.vocab_size
        params = [s.request.sampling_params for s in rows]

        def col(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        temps = [0.0 if p.greedy else p.temperature for p in params]
        meta = SamplingMetadata(temperature=col(temps), all_greedy=all(p.greedy for p in params))
        if any(p.top_p < 1 for p in params):
            meta.top_p = col([p.top_p for p in params])
        if any(0 < p.top_k < V for p in params):
            # a top_k at or above the vocabulary keeps all of it (clamped, as vLLM does)
            meta.top_k = col([p.top_k if 0 < p.top_k < V else V for p in params], torch.long)
        if any(p.min_p > 0 for p in params):
            meta.min_p = col([p.min_p for p in params])
        need_counts = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 for p in params)
        if need_counts:
            meta.output_counts = self._token_counts([s.request.output_token_ids for s in rows])
            if any(p.presence_penalty for p in params):
                meta.presence_penalty = col([p.presence_penalty for p in params])
            if any(p.frequency_penalty for p in params):
                meta.frequency_penalty = col([p.frequency_penalty for p in params])
            if any(p.repetition_penalty != 1 for p in params):
                meta.repetition_penalty = col([p.repetition_penalty for p in params])
                meta.prompt_mask = self._token_counts([s.request.prompt_token_ids for s in rows]) > 0
        under_min = [
            i for i, s in enumerate(rows) if s.request.num_output_tokens < s.request.sampling_params.min_tokens
        ]
        if under_min:
            banned = torch.zeros(len(rows), V, dtype=torch.bool, device=dev)
            for i in under_min:
                req = rows[i].request
                stop_ids = list(req.sampling_params.stop_token_ids)
                if not req.sampling_params.ignore_eos:
                    stop_ids += req.eos_token_ids
                banned[i, [t for t in stop_ids if 0 <= t < V]] = True
            meta.banned = banned
        if any(p.logit_bias for p in params):
            bias = torch.zeros(len(rows), V, device=dev)
            for i, p in enumerate(params):
                if p.logit_bias:
                    bias[i, list(p.logit_bias)] = col(list(p.logit_bias.values()))
            meta.logit_bias = bias
        masks = self.structured.fill_bitmask([s.request.grammar for s in rows]) if self.structured else None
        if masks is not None:
            meta.token_bitmask, meta.bitmask_rows = masks
        if any(p.seed is not None for p in params):
            meta.generators = [s.request.generator for s in rows]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = max(wanted) if wanted else -1
        return meta

    def _token_counts(self, lists: list[list[int]]) -> torch.Tensor:
        counts = torch.zeros(len(lists), self.vocab_size, device=self.device)
        width = max((len(x) for x in lists), default=0)
        if width:
            ids = torch.tensor([x + [0] * (width - len(x)) for x in lists], dtype=torch.long, device=self.device)
            ones = torch.tensor([[1.0] * len(x) + [0.0] * (width - len(x)) for x in lists], device=self.device)
            counts.scatter_add_(1, ids, ones)
        return counts

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        if not out.scheduled:
            return result
        input_ids, positions, meta, logits_idx = self._prepare(out.scheduled)
        hidden = self.model(input_ids, positions, meta)
        self._prompt_logprobs(out.scheduled, hidden, result)
        rows = [s for s in out.scheduled if s.samples]
        if not rows:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(logits_idx, device=self.device)])
        sm = self._sampling_metadata(rows)
        sampled = self.sampler(logits, sm)
        tokens = sampled.token_ids.tolist()
        lp = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        lp_ids = sampled.logprob_token_ids.tolist() if sampled.logprobs is not None else None
        for i, s in enumerate(rows):
            rid = s.request.request_id
            result.sampled[rid] = [tokens[i]]
            k = s.request.sampling_params.logprobs
            if lp is not None and k is not None:
                entry = {lp_ids[i][0]: lp[i][0]}
                for tok, val in zip(lp_ids[i][1 : 1 + k], lp[i][1 : 1 + k]):
                    entry.setdefault(tok, val)
                result.logprobs[rid] = [entry]
        return result

    def _prompt_logprobs(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor, result) -> None:
        """Log-softmax (float32, before any sampling transform) at the positions of this step that predict a
        prompt token not yet scored: a chunked prompt is scored chunk by chunk, a recomputed one not twice."""
        t = 0
        for s in scheduled:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            if req.wants_prompt_logprobs:
                # position p predicts token p + 1; the scored prompt tokens so far are 1 .. len(prompt_logprobs)
                lo = max(start, len(req.prompt_logprobs))
                hi = min(start + n, req.num_prompt_tokens - 1)
                if lo < hi:
                    rows = hidden[t + lo - start : t + hi - start]
                    logprobs = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
                    targets = torch.tensor(req.all_token_ids[lo + 1 : hi + 1], device=self.device)
                    chosen = logprobs.gather(1, targets.unsqueeze(1))
                    ranks = (logprobs > chosen).sum(dim=1) + 1
                    k = req.sampling_params.prompt_logprobs
                    top = logprobs.topk(k, dim=-1) if k else None
                    entries = []
                    for i, (tok, lp, rank) in enumerate(zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist())):
                        entry = {tok: (lp, rank)}
                        if top is not None:
                            for r, (tid, v) in enumerate(zip(top.indices[i].tolist(), top.values[i].tolist())):
                                entry.setdefault(tid, (v, r + 1))
                        entries.append(entry)
                    result.prompt_logprobs[req.request_id] = entries
            t += n
