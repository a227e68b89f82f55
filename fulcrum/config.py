"""The engine's settings: `EngineConfig` (every setting of one engine, checked when it is built) and `ModelConfig`
(what the engine reads from a model folder: config.json through transformers, the dtype, the context length, the EOS
ids, the quantization), with the helpers that derive them (dtype, RoPE settings, a checkpoint's own quantization).
The torch-free names and defaults the command line offers live in fulcrum.defaults and are re-exported here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from fulcrum.defaults import (  # noqa: F401  (re-exported: the engine imports them from here)
    CHECKPOINT_QUANTIZATIONS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MODEL,
    FP8_BLOCK,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    ONLINE_QUANTIZATIONS,
    QUANTIZATIONS,
    serve_max_num_batched_tokens,
)
from fulcrum.errors import InvalidRequestError, ModelLoadError
from fulcrum.model_folder.hf_config import language_model_config
from fulcrum.model_folder.pooling import POOLING_TYPES, TASKS, PoolerConfig, resolve_task
from fulcrum.model_folder.source import resolve_model

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, hf_config: PretrainedConfig) -> torch.dtype:
    """`auto` follows the checkpoint's own dtype (float32 when it states none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        stated = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(stated, torch.dtype):
            return stated
        return DTYPES.get(str(stated).removeprefix("torch."), torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def rope_parameters(hf_config: PretrainedConfig) -> dict:
    """RoPE settings in one shape, whichever convention the config uses
    (transformers 5 `rope_parameters`, or the older `rope_theta` + `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    return params


def read_eos_token_ids(path: Path, hf_config: PretrainedConfig) -> list[int]:
    """End-of-sequence ids from generation_config.json (which may list several), else config.json."""
    ids = None
    gen = path / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def model_path(model: str | Path | None) -> Path:
    """The model folder a setting names (None: the bundled model): a folder, a .gguf file's folder, or a Hub ID's
    snapshot in the local Hugging Face cache (fulcrum.model_folder.source)."""
    return resolve_model(model if model is not None else DEFAULT_MODEL)


@dataclass
class ModelConfig:
    """What the engine needs to know about one model folder."""

    path: Path
    hf_config: PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    # one of QUANTIZATIONS: linear weights quantized at load time, or a quantized checkpoint's format (its settings
    # stay in hf_config.quantization_config)
    quantization: str | None = None
    quantization_group_size: int = 128
    # "generate", or "embed": the engine pools each prompt's final hidden states into one vector (pooler)
    task: str = "generate"
    pooler: PoolerConfig | None = None
    # a vision-language checkpoint's whole config (hf_config is then its text model's: language_model_config)
    multimodal_config: PretrainedConfig | None = None

    @classmethod
    def from_path(
        cls,
        path: str | Path | None = None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        quantization: str | None = None,
        quantization_group_size: int = 128,
        task: str = "auto",
        pooling_type: str | None = None,
    ) -> ModelConfig:
        path = model_path(path)
        hf_config, multimodal_config = language_model_config(AutoConfig.from_pretrained(path, local_files_only=True))
        task, pooler = resolve_task(path, hf_config, task, pooling_type)
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
        return cls(
            path=path,
            hf_config=hf_config,
            dtype=resolve_dtype(dtype, hf_config),
            max_model_len=max_model_len or limit,
            eos_token_ids=read_eos_token_ids(path, hf_config),
            quantization=checkpoint_quantization(hf_config, quantization),
            quantization_group_size=quantization_group_size,
            task=task,
            pooler=pooler,
            multimodal_config=multimodal_config,
        )

    @classmethod
    def from_engine(cls, config: EngineConfig) -> ModelConfig:
        """The model an engine config names, with its settings."""
        return cls.from_path(
            config.model, config.dtype, config.max_model_len, config.quantization, config.quantization_group_size,
            config.task, config.pooling_type,
        )  # fmt: skip


def checkpoint_quantization(hf_config: PretrainedConfig, asked: str | None) -> str | None:
    """The quantization to load with: a quantized checkpoint's own (config.json's quantization_config), which
    `asked` may only repeat, or else `asked` (online quantization, or none)."""
    stated = getattr(hf_config, "quantization_config", None)
    if not stated:
        if asked in CHECKPOINT_QUANTIZATIONS:
            raise ModelLoadError(
                f"quantization {asked!r} reads a checkpoint quantized as {asked}, but config.json has no "
                f"quantization_config; to quantize a full-precision checkpoint use {', '.join(ONLINE_QUANTIZATIONS)}"
            )
        return asked
    method = str(stated.get("quant_method", "")).lower().replace("_", "-")
    named = method
    if method == "fp8":  # a checkpoint's fp8 (block-wise scales), read as FP8_BLOCK; online fp8 is another format
        method = FP8_BLOCK
    if method not in CHECKPOINT_QUANTIZATIONS:
        raise ModelLoadError(
            f"config.json's quantization_config has quant_method {method or None!r}, which fulcrum cannot read "
            f"(supported: {', '.join(CHECKPOINT_QUANTIZATIONS)})"
        )
    if asked not in (None, method, named):
        raise ModelLoadError(
            f"the checkpoint is already quantized ({method}), so quantization {asked!r} cannot apply: "
            f"drop it or give {method!r}"
        )
    return method


def _is_cpu_bind(value: str) -> bool:
    """auto, none, or a core list such as 0-3,6"""
    if value in ("auto", "none"):
        return True
    parts = [p.partition("-") for p in value.split(",")]
    return all(lo.isdigit() and (not sep or hi.isdigit()) for lo, sep, hi in parts)


def _is_partition(value) -> bool:
    """None, a list of layer counts, or its text 8,8,7"""
    if value is None:
        return True
    parts = value.split(",") if isinstance(value, str) else value
    return all(str(p).strip().isdigit() for p in parts)


def _lora_module(m) -> dict:
    """A --lora-modules entry as {"name", "path"}: "name=path", or vLLM's JSON object form."""
    if isinstance(m, str) and m.lstrip().startswith("{"):
        try:
            m = json.loads(m)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"lora_modules: {m!r} is not valid JSON: {e}", "lora_modules") from None
    if isinstance(m, str):
        name, sep, path = m.partition("=")
        if not sep or not name or not path:
            raise InvalidRequestError(f"lora_modules: {m!r} is not name=path", "lora_modules")
        return {"name": name, "path": path}
    if isinstance(m, dict) and isinstance(m.get("name"), str) and isinstance(m.get("path"), str):
        return {"name": m["name"], "path": m["path"]}
    raise InvalidRequestError(f"lora_modules: {m!r} is not name=path or {{'name': ..., 'path': ...}}", "lora_modules")


@dataclass
class EngineConfig:
    """Engine settings, named as in vLLM."""

    model: str | Path | None = None  # None = the bundled model
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    # tokens a step holds, decodes and prefill chunks together; None: `fulcrum serve`'s default for the device
    # (defaults.serve_max_num_batched_tokens: smaller on CPU, where a step's time grows with its tokens)
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV cache; default: 2 GiB on CPU, profiled on CUDA
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Off: a prompt is computed in one step, never split (the step budget grows to max_model_len), so a long
    # prompt stalls the decodes that share its step. Kept to measure what chunking buys.
    enable_chunked_prefill: bool = True
    seed: int = 0
    device: str | None = None  # None = cuda when present, else cpu
    # CPU compute threads of the engine core (None: one per allowed core) and where they run: "auto" pins thread i
    # to the i-th allowed core, "none" leaves placement to the OS, "0-3,6" pins to those cores (runtime/cpu_threads)
    cpu_threads: int | None = None
    cpu_bind: str = "auto"
    # the CPU engine core's niceness, 0-19 (None: 10 in a process of its own beside a frontend, as `fulcrum serve`
    # runs it, so that the frontend's short bursts run as soon as they wake; unchanged in a user's process)
    cpu_nice: int | None = None
    # vLLM's switch for eager PyTorch: here it keeps decode steps on the layer modules instead of the fused decode
    # stack (kernels/cpu_decode_stack.py), which otherwise runs a CPU decode step's layers in one C++ call, and on
    # CUDA it turns off the captured decode graphs (engine/cuda_graphs.py)
    enforce_eager: bool = False
    # vLLM's --async-scheduling: the next step is scheduled and launched before the one in flight is read back (its
    # sampled tokens reach the next step's inputs on the device), so the host's work hides behind the GPU's. Steps
    # with grammars, penalties or prompt logprobs, speculation, P/D and parallel engines run synchronously.
    async_scheduling: bool = False
    # weight-only quantization at load time (int8 per channel, int4 per group of quantization_group_size inputs)
    quantization: str | None = None
    quantization_group_size: int = 128
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # data parallel: this many engine cores behind one server frontend, each with its own KV cache and a share of
    # the CPU cores; requests go to the least loaded (engine/async_llm.py)
    data_parallel_size: int = 1
    # one model over several ranks (fulcrum.engine.workers): each rank a process (gloo on CPU, NCCL on CUDA) spawned
    # by the engine, or a Ray actor with distributed_executor_backend "ray" (which spans machines). Tensor parallel
    # splits heads, MLP and vocabulary; pipeline parallel splits the layers into stages (evenly, or as
    # pp_layer_partition "8,7,..." says); expert parallel holds whole experts per tensor-parallel rank.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: str | None = None  # "mp" (default when more than one rank) or "ray"
    pp_layer_partition: str | list[int] | None = None
    # speculative decoding, as vLLM's speculative_config: {"method": "ngram" | "draft_model", "num_speculative_tokens":
    # k, "model": the draft's folder, "prompt_lookup_min"/"max": n-gram sizes, "disable_by_batch_size"}, or its JSON
    # text; checked in full by fulcrum.engine.spec.SpeculativeConfig when the engine starts
    speculative_config: dict | None = None
    # P/D disaggregation, as vLLM's kv_transfer_config: {"kv_connector": "ZmqConnector" | "SharedMemoryConnector" |
    # "TorchDistributedConnector" (kv_transfer.config.CONNECTORS has the aliases), "kv_role": "kv_producer" |
    # "kv_consumer" | "kv_both", "kv_ip", "kv_port", "lease_timeout_s", "pull_timeout_s"}, or its JSON text;
    # checked in full by fulcrum.engine.kv_transfer.KVTransferConfig when the engine starts
    kv_transfer_config: dict | None = None
    # KV-cache events published over ZeroMQ, as vLLM's kv_events_config: {"enable_kv_cache_events": true,
    # "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": ..., "topic": ...}, or its JSON text;
    # checked in full by fulcrum.engine.kv_event_publisher.KVEventsConfig
    kv_events_config: dict | None = None
    # offload tiers below the KV pool (engine/kv_offload): blocks the pool lets go are kept in host memory (this
    # many GiB, as vLLM's kv_offloading_size) and as files under kv_offload_dir (up to kv_offload_dir_size GiB,
    # least recently used deleted first), and come back as prefix hits; the directory survives restarts and may be
    # shared by the replicas of one host
    kv_offloading_size: float | None = None
    kv_offload_dir: str | None = None
    kv_offload_dir_size: float = 16.0
    # vLLM's --task: "embed" serves embeddings (the prompt's final hidden states pooled into one vector), "generate"
    # text; "auto" is embed for a sentence-transformers folder (modules.json), else generate. pooling_type overrides
    # the folder's pooling (last, mean, cls)
    task: str = "auto"
    pooling_type: str | None = None
    # multi-LoRA (vLLM's flags): adapters in PEFT's layout, each request naming one (or none: the base model); up to
    # max_loras of them in a step, of rank max_lora_rank at most, max_cpu_loras kept in host memory (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # adapters loaded at start, as vLLM's --lora-modules: "name=path" texts or {"name": ..., "path": ...}
    lora_modules: list | None = None

    def __post_init__(self) -> None:
        for name in ("speculative_config", "kv_transfer_config", "kv_events_config"):
            if isinstance(getattr(self, name), str):
                try:
                    setattr(self, name, json.loads(getattr(self, name)))
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(f"{name} is not valid JSON: {e}", name) from None
        self.lora_modules = [_lora_module(m) for m in self.lora_modules or []]
        if self.lora_modules:
            self.enable_lora = True
        checks = {
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            "block_size": self.block_size >= 1,
            "gpu_memory_utilization": 0 < self.gpu_memory_utilization <= 1,
            "kv_cache_memory": self.kv_cache_memory is None or self.kv_cache_memory > 0,
            "cpu_threads": self.cpu_threads is None or self.cpu_threads >= 1,
            "cpu_bind": _is_cpu_bind(self.cpu_bind),
            "cpu_nice": self.cpu_nice is None or (isinstance(self.cpu_nice, int) and 0 <= self.cpu_nice <= 19),
            "quantization": self.quantization is None or self.quantization in QUANTIZATIONS,
            "quantization_group_size": self.quantization_group_size in INT4_GROUP_SIZES,
            "kv_cache_dtype": self.kv_cache_dtype in KV_CACHE_DTYPES,
            "data_parallel_size": isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1,
            "speculative_config": self.speculative_config is None or isinstance(self.speculative_config, dict),
            "tensor_parallel_size": isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            "pipeline_parallel_size": isinstance(self.pipeline_parallel_size, int) and self.pipeline_parallel_size >= 1,
            "distributed_executor_backend": self.distributed_executor_backend in (None, "mp", "ray"),
            "pp_layer_partition": _is_partition(self.pp_layer_partition),
            "kv_transfer_config": self.kv_transfer_config is None or isinstance(self.kv_transfer_config, dict),
            "kv_events_config": self.kv_events_config is None or isinstance(self.kv_events_config, dict),
            "kv_offloading_size": self.kv_offloading_size is None or self.kv_offloading_size >= 0,
            "kv_offload_dir_size": self.kv_offload_dir_size > 0,
            "task": self.task in TASKS,
            "max_loras": isinstance(self.max_loras, int) and self.max_loras >= 1,
            "max_lora_rank": isinstance(self.max_lora_rank, int) and self.max_lora_rank >= 1,
            "max_cpu_loras": self.max_cpu_loras is None or self.max_cpu_loras >= 1,
            "pooling_type": self.pooling_type is None or self.pooling_type in POOLING_TYPES,
        }
        for name, ok in checks.items():
            if not ok:
                hint = {
                    "quantization": f" (supported: {', '.join(QUANTIZATIONS)})",
                    "quantization_group_size": f" (supported: {', '.join(map(str, INT4_GROUP_SIZES))})",
                    "kv_cache_dtype": f" (supported: {', '.join(KV_CACHE_DTYPES)})",
                    "distributed_executor_backend": " (supported: mp, ray)",
                    "pp_layer_partition": " (layers per stage, such as 8,8,7)",
                }.get(name, "")
                raise InvalidRequestError(f"{name} has an invalid value: {getattr(self, name)!r}{hint}", param=name)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = serve_max_num_batched_tokens(self.device, self.max_num_seqs)
        if isinstance(self.pp_layer_partition, str):
            self.pp_layer_partition = [int(p) for p in self.pp_layer_partition.split(",")]
        if self.world_size > 1 and self.distributed_executor_backend is None:
            self.distributed_executor_backend = "mp"
        if self.kv_transfer_config is not None and self.world_size > 1:
            # each rank holds a share of every block; the connector moves rank 0's cache only
            raise InvalidRequestError(
                "kv_transfer_config (P/D disaggregation) does not work with tensor or pipeline parallelism yet",
                "kv_transfer_config",
            )
        if (self.kv_offloading_size or self.kv_offload_dir) and self.world_size > 1:
            raise InvalidRequestError(
                "KV offload (kv_offloading_size, kv_offload_dir) does not work with tensor or pipeline parallelism "
                "yet: each rank holds a share of every block",
                "kv_offload_dir",
            )
        if (self.kv_offloading_size or self.kv_offload_dir) and not self.enable_prefix_caching:
            raise InvalidRequestError(
                "KV offload needs prefix caching: offloaded blocks come back as prefix hits", "kv_offload_dir"
            )

    @property
    def world_size(self) -> int:
        """Ranks of one engine (data parallel engines are separate worlds)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
