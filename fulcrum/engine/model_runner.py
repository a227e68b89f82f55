"""The model runner: owns the weights and the KV cache, turns a scheduler step into one forward
over flattened tokens, and samples the next token of every request that reached its end (with speculative
decoding, verifies its proposals and samples one token more)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fulcrum.config import EngineConfig, ModelConfig
from fulcrum.defaults import DEFAULT_CPU_KV_BYTES
from fulcrum.distributed import parallel_state
from fulcrum.distributed.parallel_state import pp_recv_prev, pp_send_next
from fulcrum.engine import cuda_graphs, step_inputs
from fulcrum.engine.lora import LoRAManager
from fulcrum.engine.multimodal import ImageEncoder, ImageInput, MultiModalInput
from fulcrum.engine.sampling_inputs import SamplingInputs
from fulcrum.engine.scheduler import ScheduledRequest, SchedulerOutput
from fulcrum.engine.spec.rejection import verify
from fulcrum.engine.step_inputs import StepInputs
from fulcrum.engine.structured import StructuredOutputs
from fulcrum.errors import InvalidRequestError, KVCacheTooSmallError
from fulcrum.kernels import triton as triton_kernels
from fulcrum.kernels import warm_up
from fulcrum.layers.attention import Attention, AttentionMetadata, attach_kv_cache
from fulcrum.layers.sampler import Sampler
from fulcrum.models.loader import load_model
from fulcrum.models.lora import LoRAError
from fulcrum.quant import describe
from fulcrum.quant import kv as kv_quant
from fulcrum.runtime import cpu_process
from fulcrum.runtime.hugepages import huge_page_empty
from fulcrum.utils.device import to_device

log = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # per request, per new token: {token_id: logprob} (sampled token first, then the top-k)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # per request wanting prompt logprobs, for the prompt tokens this step's positions predict:
    # {token_id: (logprob, rank)}, the prompt's own token first, then the top-k
    prompt_logprobs: dict[str, list[dict[int, tuple[float, int]]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        engine_config: EngineConfig,
        model_config: ModelConfig,
        own_process: bool = False,
        draft: ModelRunner | None = None,
        is_draft: bool = False,
        agree_blocks: Callable[[int], int] | None = None,
        structured: StructuredOutputs | None = None,
    ):
        """`draft`: a speculative-decoding draft model's runner (built with is_draft, so without a cache): its cache
        gets as many blocks as this one's, both in the same memory (kv_cache_memory, or what the GPU has left).
        `agree_blocks`: in a parallel engine, turns this rank's KV block count into the one every rank holds (the
        smallest); this rank's part of the model is what parallel_state says. `structured`: the engine core's grammars,
        for the token bitmask of the requests that have one."""
        ps = parallel_state.state()
        self.world_size, self.pp_size, self.rank = ps.world_size, ps.pp_size, ps.rank
        # this runner's own place: a draft built before the target's ranks joined is a whole model, first and last
        self.first_stage, self.last_stage = ps.is_first_stage, ps.is_last_stage
        self.config = engine_config
        self.model_config = model_config
        self.device = torch.device(engine_config.device)
        torch.manual_seed(engine_config.seed)
        self.model = load_model(model_config, self.device)
        self.image_encoder = None  # a vision-language checkpoint's vision tower, built at the first image
        self.weight_bytes = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        # "gguf (Q4_K x 96, Q6_K x 25)", "int4 (group 128)"; unquantized weights say their dtype
        self.weights_format = (
            describe(
                model_config.quantization,
                model_config.quantization_group_size,
                getattr(model_config.hf_config, "quantization_config", None),
            )
            if model_config.quantization
            else str(model_config.dtype).removeprefix("torch.")
        )
        log.info("weights: %.1f MiB (%s, quantization %s)", self.weight_bytes / 2**20, model_config.dtype,
                 self.weights_format)  # fmt: skip
        stack = getattr(self.model, "model", None)
        self.lora: LoRAManager | None = None  # multi-LoRA: the adapters' slots in the layers (engine/lora.py)
        if engine_config.enable_lora and not is_draft:
            if self.world_size > 1:
                raise LoRAError(
                    "LoRA adapters run in a single-rank engine only (no tensor or pipeline parallelism yet)"
                )
            cfg = engine_config
            self.lora = LoRAManager(self.model, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras or cfg.max_loras,
                                    self.device, model_config.dtype)  # fmt: skip
        if engine_config.enforce_eager and hasattr(stack, "fused_decode"):
            stack.fused_decode = False  # decode steps on the layer modules
        if self.device.type == "cpu":
            cpu_process.settle_weights(self.model)
        self.vocab_size = model_config.hf_config.vocab_size
        self.hidden_size = model_config.hf_config.hidden_size
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
        self.sampler = Sampler()
        self.graphs: cuda_graphs.DecodeGraphs | None = None  # captured decode steps (CUDA; set once the cache is)
        self.sampling_inputs = SamplingInputs(self.device, self.vocab_size, structured)
        # Tokens of one request computed as decode rows, each over its own prefix, when it has context: a step
        # verifying k proposals (or a draft catching up a token or two) runs them all in the batched decode
        # attention, not as a prefill chunk of its own. 1 without speculation: only single-token decodes.
        spec = engine_config.speculative_config
        self.decode_rows = 1 + (spec or {}).get("num_speculative_tokens", 0)
        if is_draft:
            return  # the target sizes the cache they share (attach_kv_cache); the target's warm-up builds the kernels
        self.num_blocks = self._num_kv_blocks(draft.bytes_per_block if draft else 0)
        if agree_blocks is not None:
            self.num_blocks = agree_blocks(self.num_blocks)
        if self.num_blocks * self.block_size < model_config.max_model_len:
            raise KVCacheTooSmallError(
                f"the KV cache holds {self.num_blocks * self.block_size} tokens, fewer than max_model_len="
                f"{model_config.max_model_len}; give it more memory (kv_cache_memory / gpu_memory_utilization) "
                "or lower max_model_len"
            )
        self.attach_kv_cache(self.num_blocks)
        if draft is not None:
            draft.attach_kv_cache(self.num_blocks)
        # build or load the CPU kernels now, not in the middle of the first request
        warm_up(self.device, quantized=model_config.quantization is not None, quantized_kv=self.kv_format is not None)
        self.graphs = self._capture_graphs()
        if self.device.type == "cpu":  # after the builds, which would otherwise inherit the pinning
            cfg = engine_config
            cpu_process.place_threads(cfg.cpu_threads, cfg.cpu_bind, own_process, ps.rank, ps.world_size, cfg.cpu_nice)

    def attach_kv_cache(self, num_blocks: int) -> None:
        # On CPU zeroed, faulted in as blocks are first written, on ordinary pages: with THP defrag "madvise" (a common
        # default) huge-page faults compact memory first and made fresh blocks' first writes 4.6x slower, for no
        # gain in decode attention.
        self.num_blocks = num_blocks
        empty = (lambda shape, dtype: huge_page_empty(shape, dtype, huge=False)) if self.device.type == "cpu" else None
        self.kv_cache, self.kv_scales = attach_kv_cache(
            self.attn_layers, num_blocks, self.block_size, self.model_config.dtype, self.kv_format, self.device, empty
        )

    def _capture_graphs(self) -> cuda_graphs.DecodeGraphs | None:
        """Decode steps captured as CUDA graphs, one per batch-size bucket (engine/cuda_graphs.py); None on CPU, with
        --enforce-eager, in a parallel engine, or for a model whose decode step cannot be captured (logged)."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.world_size > 1:
            return None
        if self.lora is not None:  # the captured steps hold no adapter deltas
            log.info("CUDA graphs off: LoRA adapters are served")
            return None
        why = cuda_graphs.supported(self.model)
        if why is None and not triton_kernels.usable_on(self.device):
            why = "the Triton kernels are not in use"
        if why is not None:
            log.info("CUDA graphs off: %s", why)
            return None
        sizes = cuda_graphs.capture_sizes(self.config.max_num_seqs)
        max_blocks = -(-self.model_config.max_model_len // self.block_size)
        graphs = cuda_graphs.DecodeGraphs(self.model, self.device, sizes, max_blocks)
        t0 = time.perf_counter()
        try:
            graphs.capture()
        except Exception as e:  # a layer that syncs with the host or allocates in a way capture refuses
            log.warning("CUDA graphs off: capturing the decode step failed (%s: %s)", type(e).__name__, e)
            torch.cuda.synchronize(self.device)
            return None
        log.info("CUDA graphs: %d decode batch sizes up to %d captured in %.1f s", len(sizes), sizes[-1],
                 time.perf_counter() - t0)  # fmt: skip
        return graphs

    # -- KV cache size ---------------------------------------------------------------------------

    def _num_kv_blocks(self, draft_bytes_per_block: int = 0) -> int:
        per_block = self.bytes_per_block + draft_bytes_per_block
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory // per_block
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_BYTES // per_block
        return self._profile_cuda_blocks(per_block)

    @torch.inference_mode()
    def _profile_cuda_blocks(self, per_block: int) -> int:
        """Run the largest step the scheduler can produce, then give the KV cache what is left
        of `gpu_memory_utilization` of the card."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.model_config.max_model_len
        if self.config.enable_chunked_prefill:
            n = min(self.config.max_num_batched_tokens, n)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        ps = parallel_state.state()
        before = None if ps.is_first_stage else torch.zeros(n, self.hidden_size, dtype=self.model_config.dtype)
        hidden = self.model(ids, pos, AttentionMetadata.for_prompts([n]), before)
        rows = min(self.config.max_num_seqs, n)
        if ps.is_last_stage:
            self.model.compute_logits(hidden[:rows]).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        usable = int(total * self.config.gpu_memory_utilization) - peak - max(non_torch, 0)
        log.info("profiled peak %.2f GiB; %.2f GiB left for the KV cache", peak / 2**30, usable / 2**30)
        return max(usable, 0) // per_block

    # -- one step ----------------------------------------------------------------------------------

    # -- the forward, on every rank ----------------------------------------------------------------

    def prepare_images(self, prompt: list[int], images: ImageInput) -> MultiModalInput:
        """A request's images encoded (each image once: the encoder's cache) and laid out on its prompt."""
        if self.model_config.multimodal_config is None:
            raise InvalidRequestError(f"model {self.model_config.path.name} takes no image input", "messages")
        if self.image_encoder is None:
            mm = self.model_config.multimodal_config
            self.image_encoder = ImageEncoder(mm, self.model_config.path, self.device, self.model_config.dtype)
        return self.image_encoder.prepare(prompt, images)

    def forward_logits(
        self, steps: list[StepInputs], prev: PendingStep | None = None, pooled: dict | None = None
    ) -> list[torch.Tensor | None]:
        """Run the step's micro-batches through this rank's layers; the logits of each one's `logits_rows` on the
        last pipeline stage (None elsewhere, and for a micro-batch without such rows). Every rank of the engine runs
        this with the same inputs (rank 0 broadcasts them): tensor-parallel ranks meet in their all-reduces, a stage
        takes each micro-batch's hidden states from the one before and hands them on without waiting, so that the
        stages overlap over the micro-batches. `prev`: the step in flight, whose sampled tokens are this step's
        placeholders (async scheduling). `pooled`: filled with each embedding request's part of its vector from this
        step's hidden states (rank 0)."""
        out, sends = [], []
        for si in steps:
            in_flight = self._in_flight_tokens(si, prev)
            if self.graphs is not None and self.graphs.fits(si) and not si.pool_spans and si.mrope_positions is None:
                out.append(self.graphs.run(si, in_flight))  # a decode step: one graph replay
                continue
            varlen = triton_kernels.usable_on(self.device)  # only the Triton attention reads a mixed step's varlen view
            input_ids, positions, meta = step_inputs.to_tensors(si, self.device, varlen)
            if in_flight is not None:
                input_ids[in_flight[0]] = in_flight[1]
            hidden = None
            if not self.first_stage:
                hidden = pp_recv_prev((len(si.ids), self.hidden_size), self.model_config.dtype, self.device)
            image_rows = None
            if si.mrope_positions is not None:  # a step with a vision-language prompt's tokens
                positions = torch.tensor(si.mrope_positions, dtype=torch.long, device=self.device)
            if si.image_rows:
                rows = torch.tensor(si.image_rows, dtype=torch.long, device=self.device)
                image_rows = (rows, torch.cat(si.image_embeds).to(self.device))
            h = self.model(input_ids, positions, meta, hidden, image_rows)
            if not self.last_stage:
                sends.append((pp_send_next(h), h))  # h lives until its send is done
                out.append(None)
                continue
            if si.pool_spans and pooled is not None:
                pooled.update(_pool_rows(h, si))
            if si.logits_rows:
                out.append(self.model.compute_logits(h[to_device(si.logits_rows, self.device, torch.long)]))
            else:
                out.append(None)
        for work, _ in sends:
            work.wait()
        return out

    def _in_flight_tokens(self, si: StepInputs, prev: PendingStep | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, token ids) of the step's placeholders, the ids read from the step in flight where they lie (on the
        device: no wait for them)."""
        if not si.placeholders:
            return None
        if prev is None or prev.token_ids is None:
            raise RuntimeError("a step has tokens in flight but no step in flight samples them")
        index = prev.index()
        rows = [r for r, _ in si.placeholders]
        src = [index[rid] for _, rid in si.placeholders]
        rows, src = to_device([rows, src], self.device, torch.long)
        return rows, prev.token_ids[src]

    def _run(
        self, scheduled: list[ScheduledRequest], prev: PendingStep | None = None
    ) -> tuple[list[StepInputs], list[torch.Tensor | None]]:
        """Rank 0's part: the step's inputs (split into micro-batches under pipeline parallelism), sent to the other
        ranks, then its own forward."""
        # one micro-batch per pipeline stage, so that each stage has one to work on while the next takes its last
        groups = step_inputs.split(scheduled, self.pp_size)
        steps = [step_inputs.build(g, self.block_size, self.decode_rows) for g in groups]
        if self.world_size > 1:
            parallel_state.broadcast_control(("step", [si.for_other_ranks() for si in steps]))
        if self.lora is not None:  # each token's adapter slot, in the step's token order
            self.lora.prepare([s.request.lora_name for s in scheduled], [s.num_new_tokens for s in scheduled])
        pooled: dict[str, torch.Tensor] = {}
        try:
            logits = self.forward_logits(steps, prev, pooled)
        finally:
            if self.lora is not None:
                self.lora.finish_step()
        if pooled or any(si.pool_spans for si in steps):
            _take_pooled(scheduled, pooled)
        return steps, logits

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: PendingStep | None = None) -> PendingStep:
        """Run the step and sample, leaving the sampled tokens where they are (`PendingStep.result` reads them back):
        on a GPU this returns once the work is queued. `prev`: the step in flight (async scheduling)."""
        result = ModelRunnerOutput()
        if not out.scheduled:
            return PendingStep(result)
        steps, logits = self._run(out.scheduled, prev)
        sample_logits = []
        for si, lg in zip(steps, logits):
            if lg is None:
                continue
            if si.spans:
                requests = {s.request.request_id: s.request for s in out.scheduled}
                self._prompt_logprobs(si, lg[: si.num_prompt_rows], requests, result)
            sample_logits.append(lg[si.num_prompt_rows :])
        rows = [s for s in out.scheduled if s.samples_next_token]
        if not rows:
            return PendingStep(result)
        logits = torch.cat(sample_logits) if len(sample_logits) > 1 else sample_logits[0]
        if any(s.spec_token_ids for s in rows):
            self._verify(rows, logits, result)
            return PendingStep(result)
        sampled = self.sampler(logits, self.sampling_inputs.build([s.request for s in rows]))
        return PendingStep(result, [(s.request.request_id, s.request.sampling_params.logprobs) for s in rows], sampled)

    def _verify(self, rows: list[ScheduledRequest], logits: torch.Tensor, result: ModelRunnerOutput) -> None:
        """A step with proposals: each sampling request has 1 + len(proposals) rows of logits; rejection sampling
        (engine/spec/rejection.py) keeps a prefix of its proposals and draws one token more."""
        reqs, ahead = [], []
        for s in rows:
            for j in range(len(s.spec_token_ids) + 1):
                reqs.append(s.request)
                ahead.append(s.spec_token_ids[:j])
        v = verify(
            self.sampler,
            logits,
            self.sampling_inputs.build(reqs, ahead),
            [s.spec_token_ids for s in rows],
            [s.spec_token_probs for s in rows],
            [s.request.generator for s in rows],
        )
        for i, s in enumerate(rows):
            rid = s.request.request_id
            result.sampled[rid] = v.tokens[i]
            k = s.request.sampling_params.logprobs
            if v.logprobs is not None and k is not None:
                lp, ids = (x.tolist() for x in v.logprobs[i])
                result.logprobs[rid] = [_logprob_entry(ids[t], lp[t], k) for t in range(len(v.tokens[i]))]

    @torch.inference_mode()
    def last_logits(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """One forward over the step; the logits at each request's last token [len(scheduled), V] (a draft model's
        step: its proposals are drawn by the caller)."""
        si = step_inputs.build(scheduled, self.block_size, self.decode_rows)
        si.logits_rows, si.num_prompt_rows = si.last_idx, 0
        return self.forward_logits([si])[0]

    def _prompt_logprobs(self, si: StepInputs, logits: torch.Tensor, requests: dict, result: ModelRunnerOutput) -> None:
        """Log-softmax (float32, before any sampling transform) at the positions of this step that predict a
        prompt token not yet scored: a chunked prompt is scored chunk by chunk, a recomputed one not twice."""
        for span in si.spans:
            req = requests[span.request_id]
            logprobs = torch.log_softmax(logits[span.row : span.row + span.hi - span.lo].float(), dim=-1)
            targets = torch.tensor(req.all_token_ids[span.lo + 1 : span.hi + 1], device=self.device)
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


class PendingStep:
    """A launched step: what is known already, and its sampled tokens (with their logprobs) on their way back. On
    CUDA they are copied into pinned memory without waiting; `result` waits for that copy alone."""

    def __init__(self, result: ModelRunnerOutput, rows: list[tuple[str, int | None]] = (), sampled=None):
        self._result, self.rows = result, list(rows)
        self.token_ids = None if sampled is None else sampled.token_ids  # [rows] where sampled: the next step reads it
        self._host, self._event = None, None
        if sampled is None:
            return
        tensors = [sampled.token_ids]
        if sampled.logprobs is not None:
            tensors += [sampled.logprobs, sampled.logprob_token_ids]
        if self.token_ids.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(self._host, tensors):
                host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    def index(self) -> dict[str, int]:
        """Each sampling request's row in `token_ids`."""
        return {rid: i for i, (rid, _) in enumerate(self.rows)}

    def result(self) -> ModelRunnerOutput:
        if self._host is not None:
            if self._event is not None:
                self._event.synchronize()
            tokens, *lp = (t.tolist() for t in self._host)
            for i, (rid, k) in enumerate(self.rows):
                self._result.sampled[rid] = [tokens[i]]
                if lp and k is not None:
                    self._result.logprobs[rid] = [_logprob_entry(lp[1][i], lp[0][i], k)]
            self._host = None
        return self._result


def _pool_rows(h: torch.Tensor, si: StepInputs) -> dict[str, torch.Tensor]:
    """Each embedding request's part of its vector from this step's final hidden states (float32): the sum of its
    rows for mean pooling, its first prompt position's for CLS, its last's for last-token pooling (a part only where
    this step holds that position)."""
    parts = {}
    for span in si.pool_spans:
        kind = span.pooling_type
        if kind == "mean":
            parts[span.request_id] = h[span.row : span.row + span.n].float().sum(0)
        elif kind == "cls" and span.start == 0:
            parts[span.request_id] = h[span.row].float()
        elif kind == "last" and span.last:
            parts[span.request_id] = h[span.row + span.n - 1].float()
    return parts


def _take_pooled(scheduled: list[ScheduledRequest], pooled: dict[str, torch.Tensor]) -> None:
    """Fold this step's parts into each embedding request's state (a prompt in chunks pools over several steps; a
    preempted one starts again from its first position); a request whose prompt ended gets its vector: the mean
    divided by the prompt's length, cut to `dimensions`, then L2-normalised when asked."""
    for s in scheduled:
        req = s.request
        params = req.sampling_params.pooling
        if params is None:
            continue
        part = pooled.get(req.request_id)
        if part is not None:
            first = req.num_computed_tokens == 0 or req.pool_state is None
            req.pool_state = part if params.pooling_type != "mean" or first else req.pool_state + part
        if not s.pools_last_chunk:
            continue
        v = req.pool_state
        if params.pooling_type == "mean":
            v = v / req.num_prompt_tokens
        if params.dimensions is not None:
            v = v[: params.dimensions]
        if params.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        req.embedding, req.pool_state = v.tolist(), None


def _logprob_entry(ids: list[int], values: list[float], k: int) -> dict[int, float]:
    """{token: logprob} of the sampled token, then its top k (the sampled one first, even when among them)."""
    entry = {ids[0]: values[0]}
    for tok, val in zip(ids[1 : 1 + k], values[1 : 1 + k]):
        entry.setdefault(tok, val)
    return entry
