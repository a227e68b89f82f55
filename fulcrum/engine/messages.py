"""The message protocol between the frontend and the engine-core process (msgpack via msgspec)."""

from __future__ import annotations

import msgspec

from fulcrum.engine.multimodal import ImageInput
from fulcrum.engine.outputs import EngineCoreOutput
from fulcrum.model_folder.pooling import PoolerConfig
from fulcrum.sampling_params import SamplingParams

# frame 0 of a frontend -> core message
ADD, ABORT, FINISH, SHUTDOWN, LORA = b"add", b"abort", b"finish", b"shutdown", b"lora"


class AddRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    kv_transfer_params: dict | None = None
    lora_name: str | None = None
    images: ImageInput | None = None  # a vision-language prompt's images (engine/multimodal.py)


class SchedulerStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0  # cumulative
    prefix_cache_hits: int = 0  # cumulative
    num_preemptions: int = 0  # cumulative
    step_time: float = 0.0  # seconds of the last step
    # speculative decoding (cumulative; engine/spec/stats.py): request-steps that verified proposals, proposals
    # verified, of those kept, and kept per position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    # the draft model's own KV cache (0 blocks without one)
    draft_num_blocks: int = 0
    draft_num_free_blocks: int = 0
    # P/D disaggregation (engine/kv_transfer; cumulative but for the last two, gauges)
    kv_transfer_bytes_sent: int = 0
    kv_transfer_bytes_received: int = 0
    kv_transfer_blocks_received: int = 0
    kv_transfer_pulls: int = 0
    kv_transfer_inline_pulls: int = 0  # of those, the ones whose bytes came as TCP frames (shm's ENOSPC fallback too)
    kv_transfer_seconds: float = 0.0
    kv_transfer_fallbacks: int = 0
    kv_transfer_leases_expired: int = 0
    kv_transfer_held_blocks: int = 0  # blocks a producer holds for pulls not yet made
    kv_transfer_pending: int = 0  # requests waiting for their pull
    # offload tiers (engine/kv_offload): per tier (ram, disk) cumulative hits, stores and errors in blocks and bytes,
    # occupancy and capacity (gauges); latency histograms "load:ram" ... as bucket counts, then the sum in microseconds
    kv_offload: dict[str, int] = msgspec.field(default_factory=dict)
    kv_offload_latency: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # LoRA (engine/lora.py): requests running and waiting per adapter (gauges), adapters put in a slot and taken out
    # of one for another (cumulative)
    lora_running: dict[str, int] = msgspec.field(default_factory=dict)
    lora_waiting: dict[str, int] = msgspec.field(default_factory=dict)
    lora_loads: int = 0
    lora_evictions: int = 0


class LoRACall(msgspec.Struct):
    """Load ("load": `name` from the PEFT folder `path`), unload ("unload") or list ("list") LoRA adapters; the core
    answers with a CallReply of the same call_id."""

    call_id: int
    op: str
    name: str = ""
    path: str = ""


class CallReply(msgspec.Struct):
    call_id: int
    error: str | None = None  # why the call failed (a bad adapter, a name taken or unknown, adapters in use)
    names: list[str] = msgspec.field(default_factory=list)  # the adapters loaded after the call
    param: str | None = None  # with an error: the request field at fault (lora_name, lora_path)


class CoreReady(msgspec.Struct):
    num_blocks: int = 0
    block_size: int = 0
    max_model_len: int = 0
    vocab_size: int = 0
    error: str | None = None  # set when the core failed to start
    kv_cache_dtype: str = ""  # what the cache stores: the model's dtype, fp8 or int8
    kv_transfer: dict | None = None  # a KV producer/consumer: its role and cache layout, for the handshake
    weights: str = ""  # the weights' format, as the startup line says it ("gguf (Q4_K x 96, Q6_K x 25)", "int8")
    weight_bytes: int = 0  # what the loaded weights hold
    task: str = "generate"  # or "embed": the model serves embeddings (model_folder/pooling.py)
    pooler: PoolerConfig | None = None  # an embedding model's pooling
    hidden_size: int = 0  # an embedding's full length
    max_loras: int = 0  # adapters in one step at most; 0: the engine serves no LoRA adapters


class CoreOutputs(msgspec.Struct):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float = 0.0
    replies: list[CallReply] = msgspec.field(default_factory=list)  # answers to LoRA calls


encoder = msgspec.msgpack.Encoder()
decode_add = msgspec.msgpack.Decoder(AddRequest).decode
decode_ids = msgspec.msgpack.Decoder(list[str]).decode
decode_lora_call = msgspec.msgpack.Decoder(LoRACall).decode
decode_outputs = msgspec.msgpack.Decoder(CoreOutputs).decode
decode_ready = msgspec.msgpack.Decoder(CoreReady).decode
