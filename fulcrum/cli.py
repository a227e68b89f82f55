"""`fulcrum <verb>`: the one entry point."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from fulcrum.defaults import (
    COMPILE_MEMORY_ENV,
    COMPILE_TIMEOUT_ENV,
    DEFAULT_COMPILE_MEMORY_MB,
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_GRAMMAR_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MODEL,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    MAX_GRAMMAR_BYTES_ENV,
    QUANTIZATIONS,
)
from fulcrum.sampling_params import DEFAULT_MAX_TOKENS
from fulcrum.utils.arg_types import non_negative_float, non_negative_seconds, positive_int
from fulcrum.utils.config_file import ConfigFileError, add_config_argument, expand_argv


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder (default: the bundled model)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens a step holds, decodes and prefill chunks together (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS}; "
        f"`fulcrum serve` on CPU: {DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS}, or --max-num-seqs where larger)",
    )
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=float, default=None, help="GiB for the KV cache (CPU default 2)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true", help="compute each prompt in one step, never split")
    g.add_argument("--seed", type=int, default=0, help="engine seed")
    g.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="quantize the linear weights at load time: int8 or fp8 (e4m3) per channel, int4 per group; a GPTQ, "
        "AWQ or compressed-tensors checkpoint is read as its config.json says (naming it here is optional)",
    )
    g.add_argument(
        "--quantization-group-size", type=int, choices=INT4_GROUP_SIZES, default=128, help="int4's group size"
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache storage: auto (the model's dtype), or fp8 (e4m3) / int8 with a scale per token and head, "
        "about twice the tokens of a 16-bit cache in the same memory",
    )
    g.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", "model": DRAFT_FOLDER, '
        '"num_speculative_tokens": 4}; "disable_by_batch_size": N stops proposing above N running requests '
        "(default on CPU 2, the crossover measured there; null: never)",
    )
    g.add_argument(
        "--data-parallel-size", "-dp", type=int, default=1,
        help="engine cores, each with its own KV cache and a share of the CPU cores; requests go to the least loaded",
    )  # fmt: skip
    g.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="ranks that split each layer (heads, MLP, vocabulary), one process each",
    )  # fmt: skip
    g.add_argument(
        "--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages the layers are split into"
    )
    g.add_argument(
        "--pp-layer-partition", default=None, help="layers per pipeline stage, such as 8,8,7 (default: even split)"
    )
    g.add_argument(
        "--enable-expert-parallel", action="store_true",
        help="MoE models: whole experts per tensor-parallel rank instead of a slice of each",
    )  # fmt: skip
    g.add_argument(
        "--distributed-executor-backend", choices=("mp", "ray"), default=None,
        help="where the ranks run: mp (processes on this machine, the default) or ray (actors on a Ray cluster: "
        "`ray start --head` on one machine, `ray start --address` on the others)",
    )  # fmt: skip
    g.add_argument(
        "--kv-transfer-config",
        type=_kv_transfer_config,
        default=None,
        help='P/D disaggregation, as vLLM\'s JSON: {"kv_connector": "ZmqConnector" (TCP) | "SharedMemoryConnector" '
        '(one host) | "TorchDistributedConnector" (NCCL on CUDA, gloo on CPU), "kv_role": "kv_producer" | '
        '"kv_consumer" | "kv_both", "kv_ip": "127.0.0.1", "kv_port": 0, "lease_timeout_s": 30, "pull_timeout_s": 10, '
        '"max_held_fraction": 0.5}',
    )
    g.add_argument(
        "--kv-role",
        choices=["producer", "consumer", "both", "kv_producer", "kv_consumer", "kv_both"],
        default=None,
        help="P/D disaggregation: this engine prefills for others (producer), decodes from others' KV (consumer) "
        "or both (the CPU connector, default settings; --kv-transfer-config for the rest)",
    )
    g.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        help='publish KV-cache events over ZeroMQ, as vLLM\'s JSON: {"enable_kv_cache_events": true, "publisher": '
        '"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"} '
        "(for fulcrum router --policy kv-events; data-parallel ranks add their rank to both ports: leave room)",
    )
    g.add_argument(
        "--kv-offloading-size", type=float, default=None, metavar="GiB",
        help="offload tier in host memory: prefix blocks the KV pool lets go are kept here (this many GiB, least "
        "recently used evicted) and come back as prefix hits instead of being recomputed",
    )  # fmt: skip
    g.add_argument(
        "--kv-offload-dir", default=None, metavar="DIR",
        help="offload tier on disk: prefix blocks kept as files here, checked by checksum, found again after a "
        "restart with the same model and settings, and shared by replicas that point at the same directory",
    )  # fmt: skip
    g.add_argument(
        "--kv-offload-dir-size", type=float, default=16.0, metavar="GiB",
        help="cap of --kv-offload-dir; least recently used blocks are deleted above it (default 16)",
    )  # fmt: skip
    g.add_argument(
        "--task", choices=("auto", "generate", "embed"), default="auto",
        help="embed: serve embeddings (/v1/embeddings, LLM.embed) by pooling each input's final hidden states; auto: "
        "embed for a sentence-transformers folder (modules.json), else generate",
    )  # fmt: skip
    g.add_argument(
        "--pooling-type", choices=("last", "mean", "cls"), default=None,
        help="an embedding model's pooling (default: its Pooling module's, else the last token)",
    )  # fmt: skip
    lg = p.add_argument_group("LoRA adapters")
    lg.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (on with --lora-modules)")
    lg.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
        help="PEFT adapter folders loaded at start, each served under its name (a request's model field picks it); "
        "vLLM's JSON form {\"name\": ..., \"path\": ...} too",
    )  # fmt: skip
    lg.add_argument("--max-loras", type=int, default=4, help="adapters in one step at most (default 4)")
    lg.add_argument("--max-lora-rank", type=int, default=16, help="the highest adapter rank served (default 16)")
    lg.add_argument(
        "--max-cpu-loras", type=int, default=None,
        help="adapters kept in host memory, least recently used dropped and read again when asked for (default: "
        "--max-loras)",
    )  # fmt: skip
    lg.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, which is read too)",
    )  # fmt: skip
    g.add_argument("--cpu-threads", type=int, default=None, help="CPU compute threads (default: one per core)")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step through the layer modules: no fused CPU decode stack, no CUDA graphs (as vLLM's flag)",
    )
    g.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule and launch each step before the previous one's tokens are read back (a GPU's host work "
        "hides behind its compute); steps with grammars, penalties or prompt logprobs run synchronously",
    )
    g.add_argument(
        "--cpu-bind",
        default="auto",
        help="where CPU compute threads run: auto (thread i on the i-th allowed core), none (the OS decides), "
        "or cores such as 0-3,6",
    )
    g.add_argument(
        "--cpu-nice", type=int, default=None, metavar="N",
        help="the CPU engine core's niceness, 0-19 (default 10 under `serve`: the HTTP frontend's short bursts run "
        "before the compute threads they share the cores with; 0 keeps the engine at the frontend's priority)",
    )  # fmt: skip


def _json_config(check):
    """An argument type for a JSON config checked by `check`, so that a typo is a usage error, not a failed start."""

    def parse(text: str) -> dict:
        from fulcrum.errors import InvalidRequestError

        try:
            value = json.loads(text)
            check(value)
        except (json.JSONDecodeError, InvalidRequestError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return parse


def _speculative_config(text: str) -> dict:
    from fulcrum.engine.spec.config import SpeculativeConfig

    return _json_config(SpeculativeConfig.parse)(text)


def _kv_transfer_config(text: str) -> dict:
    from fulcrum.engine.kv_transfer import KVTransferConfig

    return _json_config(KVTransferConfig.parse)(text)


def kv_transfer_config(args: argparse.Namespace) -> dict | None:
    """--kv-transfer-config with --kv-role folded in (either alone will do)."""
    cfg, role = getattr(args, "kv_transfer_config", None), getattr(args, "kv_role", None)
    if role is None:
        return cfg
    from fulcrum.engine.kv_transfer import KVTransferConfig
    from fulcrum.errors import InvalidRequestError

    try:
        KVTransferConfig.parse(cfg, role)
    except InvalidRequestError as e:
        raise SystemExit(f"fulcrum: {e}") from None
    return {**(cfg or {}), "kv_role": (cfg or {}).get("kv_role", role)}


def _kv_events_config(text: str) -> dict:
    """--kv-events-config's JSON, checked here: a typo is a usage error, not a replica that publishes nothing."""
    from fulcrum.engine.kv_event_publisher import KVEventsConfig
    from fulcrum.errors import InvalidRequestError

    try:
        value = json.loads(text)
        KVEventsConfig.parse(value)
    except (json.JSONDecodeError, InvalidRequestError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def engine_kwargs(args: argparse.Namespace, serving: bool = False) -> dict:
    """EngineConfig's arguments from the engine flags. `serving` (`fulcrum serve`): a step budget not given is the
    server's default for the device (EngineConfig resolves None), else the engine's."""
    budget = args.max_num_batched_tokens
    return dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget if budget is not None or serving else DEFAULT_MAX_NUM_BATCHED_TOKENS,
        block_size=args.block_size,
        kv_cache_memory=int(args.kv_cache_memory * 2**30) if args.kv_cache_memory else None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        seed=args.seed,
        cpu_threads=args.cpu_threads,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        kv_cache_dtype=args.kv_cache_dtype,
        cpu_bind=args.cpu_bind,
        cpu_nice=args.cpu_nice,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        speculative_config=args.speculative_config,
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pp_layer_partition=args.pp_layer_partition,
        enable_expert_parallel=args.enable_expert_parallel,
        distributed_executor_backend=args.distributed_executor_backend,
        kv_transfer_config=kv_transfer_config(args),
        kv_events_config=args.kv_events_config,
        kv_offloading_size=args.kv_offloading_size,
        kv_offload_dir=args.kv_offload_dir,
        kv_offload_dir_size=args.kv_offload_dir_size,
        task=args.task,
        pooling_type=args.pooling_type,
        enable_lora=args.enable_lora,
        lora_modules=args.lora_modules,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-tokens", type=int, default=0)


def sampling_params(args: argparse.Namespace):
    from fulcrum.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        seed=args.sample_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
    )


def _generate(args: argparse.Namespace) -> int:
    from fulcrum.engine.llm import LLM
    from fulcrum.errors import FulcrumError

    try:
        sp = sampling_params(args)
        llm = LLM(**engine_kwargs(args))
        if args.chat:
            from fulcrum.utils.tokenizer import chat_prompt_ids

            ids = chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": args.prompt}])
        else:
            ids = llm.tokenizer(args.prompt)["input_ids"]
            sys.stdout.write(args.prompt)
        llm.add_request(args.prompt, ids, sp)
    except (FulcrumError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    n = 0
    finish = error = None
    while llm.core.has_unfinished_requests():
        for ro, deltas in llm.step():
            sys.stdout.write(deltas.get(0, ""))
            sys.stdout.flush()
            n = len(ro.outputs[0].token_ids)
            finish, error = ro.outputs[0].finish_reason, ro.outputs[0].error
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"[{n} tokens in {dt:.2f} s, {n / max(dt, 1e-9):.1f} tok/s, finish: {finish}]", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from fulcrum.config import EngineConfig
    from fulcrum.errors import FulcrumError
    from fulcrum.server.launch import serve

    if args.model_pos:
        args.model = args.model_pos
    # read where grammars are checked (the frontend) and compiled (the engine core, which inherits the environment)
    os.environ[MAX_GRAMMAR_BYTES_ENV] = str(args.max_grammar_bytes)
    os.environ[COMPILE_TIMEOUT_ENV] = str(args.grammar_compile_timeout)
    os.environ[COMPILE_MEMORY_ENV] = str(args.grammar_compile_memory)
    if args.allow_runtime_lora_updating:
        os.environ["FULCRUM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    try:
        config = EngineConfig(**engine_kwargs(args, serving=True))
    except (FulcrumError, ValueError) as e:  # a flag's value: one line, as `fulcrum generate` answers
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve(
        config,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        metrics_compat=args.metrics_compat,
        max_waiting_requests=args.max_waiting_requests,
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        allowed_origins=args.allowed_origins,
        max_body_mb=args.max_request_body_mb,
        header_timeout=args.header_timeout,
        ui=args.ui,
    )


def build_parser() -> argparse.ArgumentParser:
    from fulcrum.server.tool_parsers import TOOL_PARSERS

    p = argparse.ArgumentParser(prog="fulcrum", description="LLM inference engine and inference-engineering toolkit")
    sub = p.add_subparsers(dest="verb", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_engine_args(g)
    add_sampling_args(g)
    add_config_argument(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    s.add_argument("model_pos", nargs="?", metavar="MODEL", help="model folder (default: the bundled model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on API routes")
    s.add_argument("--served-model-name", default=None, help="the model name clients use (default: folder name)")
    s.add_argument("--metrics-compat", choices=["vllm"], default=None, help="also expose metrics under vLLM names")
    s.add_argument("--max-waiting-requests", type=int, default=1024, help="beyond this, answer 503 + Retry-After")
    s.add_argument(
        "--drain-timeout",
        type=non_negative_seconds,
        default=30.0,
        help="seconds to finish in-flight requests on SIGTERM",
    )
    s.add_argument(
        "--max-request-body-mb",
        type=non_negative_float,
        default=DEFAULT_MAX_BODY_MB,
        help=f"request bodies larger than this many MiB get 413 (default {DEFAULT_MAX_BODY_MB:g})",
    )
    s.add_argument(
        "--header-timeout",
        type=non_negative_seconds,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a connection may take to send a request's headers before it is closed "
        f"(default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    s.add_argument(
        "--max-grammar-bytes",
        type=positive_int,
        default=DEFAULT_MAX_GRAMMAR_BYTES,
        help="the largest structured-output spec (JSON schema, regex, grammar, tools' schemas) a request may give, "
        f"in bytes; larger ones get 400 (default {DEFAULT_MAX_GRAMMAR_BYTES})",
    )
    s.add_argument(
        "--grammar-compile-timeout",
        type=non_negative_seconds,
        default=DEFAULT_COMPILE_TIMEOUT_S,
        help=f"seconds a request's grammar may take to compile before the request fails "
        f"(default {DEFAULT_COMPILE_TIMEOUT_S:g})",
    )
    s.add_argument(
        "--grammar-compile-memory",
        type=positive_int,
        default=DEFAULT_COMPILE_MEMORY_MB,
        help="MiB one grammar compile may use (it runs in a worker process); a compile that needs more fails its "
        f"request with a message naming this limit (default {DEFAULT_COMPILE_MEMORY_MB})",
    )
    s.add_argument(
        "--allowed-origins",
        type=lambda v: [o.strip() for o in v.split(",") if o.strip()],
        default=[],
        help="web origins allowed to call the API from a browser (CORS), comma-separated, or * for any; "
        "default: none (CORS off)",
    )
    s.add_argument("--log-level", default="info")
    s.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="no web page at / (chat playground, live dashboard, benchmark viewer)",
    )
    s.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how the model writes tool calls (tool_choice auto needs it; required and named work without it)",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=("deepseek_r1", "gpt_oss", "qwen3"),
        default=None,
        help="a reasoning model's thought (<think>...</think>) goes to reasoning_content, split from the answer: "
        "qwen3 (the model opens the block) or deepseek_r1 (the chat template opens it in the prompt); gpt_oss: "
        "harmony's analysis channel is the thought, its final channel the answer",
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: tool_choice auto is on whenever --tool-call-parser is given",
    )
    add_engine_args(s)
    add_config_argument(s)
    s.set_defaults(func=_serve)

    from fulcrum.bench.cli import add_bench_parser
    from fulcrum.eval.cli import add_eval_parser
    from fulcrum.plan.cli import add_plan_parser
    from fulcrum.router.cli import add_router_parsers
    from fulcrum.sim.cli import add_sim_parser
    from fulcrum.tune.cli import add_tune_parser

    add_bench_parser(sub)
    add_eval_parser(sub)
    add_router_parsers(sub)
    add_tune_parser(sub)
    add_sim_parser(sub)
    # plan/ imports neither torch (which fulcrum.config does) nor what measures: the CLI joins them, handing it the
    # bundled model as the default and fulcrum.probe's measurements
    add_plan_parser(sub).set_defaults(
        model=str(DEFAULT_MODEL),
        measure_machine=_measure_machine,
        measure_engine=_measure_engine,
        local_step_costs=_local_step_costs,
    )
    return p


def _measure_machine(*args, **kwargs):
    """This machine at a model's shapes, for `fulcrum plan --hardware local` and `--validate`."""
    from fulcrum.probe.machine import measure_machine

    return measure_machine(*args, **kwargs)


def _measure_engine(**kwargs):
    """The engine's own prefill and decode speed, for `fulcrum plan --validate`."""
    from fulcrum.probe.engine_speed import measure_speed

    return measure_speed(**kwargs)


def _local_step_costs(*args, **kwargs):
    """This machine's calibrated step costs for an engine's settings (calibrated now when there are none), for
    `fulcrum plan --hardware local` and `--validate`."""
    from fulcrum.probe.step_costs import local_step_costs

    return local_step_costs(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        # a verb's --config FILE: its flags go before the command line's, which override them
        args = parser.parse_args(expand_argv(parser, sys.argv[1:] if argv is None else argv))
        return args.func(args)
    except ConfigFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a verb installs its own handling (e.g. while imports load)
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
