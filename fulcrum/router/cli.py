"""`fulcrum router`, `fulcrum autoscale` and `fulcrum deploy k8s`: their arguments, and the runs."""

from __future__ import annotations

import argparse
import shlex

from fulcrum.router.policies import POLICIES
from fulcrum.utils.arg_types import non_negative_seconds


def add_routing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--policy", choices=sorted(POLICIES), default="round-robin")
    g.add_argument("--model", default=None, help="tokenizer folder or Hub ID (prefix and weighted policies)")
    g.add_argument("--balance-margin", type=float, default=4.0,
                   help="prefix: the prefix holder is passed over when its load exceeds the least-loaded's by more")  # fmt: skip
    g.add_argument("--prefix-weight", type=float, default=1.0, help="weighted: score per cached fraction of the prompt")
    g.add_argument("--load-weight", type=float, default=0.1, help="weighted: score lost per request of load")
    g.add_argument(
        "--sticky-header", default=None, help="requests with the same value of this header stay on a replica"
    )
    g.add_argument("--sticky-user", action="store_true", help="requests with the same `user` field stay on a replica")
    g.add_argument("--max-attempts", type=int, default=3, help="replicas tried before the first token")
    g.add_argument("--first-token-timeout", type=float, default=60.0)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--scrape-interval", type=float, default=0.25, help="seconds between /health + /metrics checks")
    g.add_argument("--stale-after", type=float, default=2.0, help="a scrape older than this counts as saturated")
    g.add_argument("--no-validate", dest="validate", action="store_false",
                   help="forward fields fulcrum's schemas refuse (a vLLM or SGLang pool)")  # fmt: skip
    g.add_argument("--api-key", default=None)
    g.add_argument("--log-level", default="info")
    g.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="no web page at / (the dashboard of the replicas, a chat playground, a benchmark viewer)",
    )
    k = p.add_argument_group("KV-cache events (kv-events policy; weighted uses them when given)")
    k.add_argument("--kv-events-endpoint", action="append", default=[], metavar="ENDPOINT",
                   help="a replica's ZeroMQ events endpoint, e.g. tcp://host:5557: one per --replica, in order")  # fmt: skip
    k.add_argument("--kv-events-replay-endpoint", action="append", default=[], metavar="ENDPOINT",
                   help="a replica's replay endpoint (missed batches are fetched there): one per --replica")  # fmt: skip
    k.add_argument("--kv-events-port", type=int, default=None,
                   help="for replicas without an endpoint flag: this port on the replica's host (--discover)")  # fmt: skip
    k.add_argument("--kv-events-replay-port", type=int, default=None, help="the same for replay endpoints")
    k.add_argument("--kv-events-topic", default="", help="the replicas' kv_events_config topic")


def _paired(args, flag: str, values: list[str]) -> dict[str, str]:
    replicas = [u.rstrip("/") for u in getattr(args, "replica", None) or []]
    if values and len(values) != len(replicas):
        raise SystemExit(f"fulcrum router: give one {flag} per --replica ({len(replicas)}), not {len(values)}")
    return dict(zip(replicas, values))


def router_config(args, backend_events: bool = False):
    """`backend_events`: the replicas' backend gives each its events endpoints (fulcrum autoscale --backend local)."""
    from fulcrum.router.app import RouterConfig

    endpoints = _paired(args, "--kv-events-endpoint", args.kv_events_endpoint)
    replays = _paired(args, "--kv-events-replay-endpoint", args.kv_events_replay_endpoint)
    if args.policy == "kv-events" and not args.model:
        raise SystemExit("fulcrum router: --policy kv-events needs --model (the replicas' tokenizer folder or Hub "
                         "ID): the block hashes it looks up must be the ones the engines publish")  # fmt: skip
    if args.policy == "kv-events" and not endpoints and args.kv_events_port is None and not backend_events:
        raise SystemExit("fulcrum router: --policy kv-events needs --kv-events-endpoint (one per --replica) "
                         "or --kv-events-port")  # fmt: skip
    return RouterConfig(
        policy=args.policy, model=args.model, balance_margin=args.balance_margin, prefix_weight=args.prefix_weight,
        load_weight=args.load_weight, sticky_header=args.sticky_header, sticky_user=args.sticky_user,
        max_attempts=args.max_attempts, first_token_timeout=args.first_token_timeout,
        request_timeout=args.request_timeout, validate=args.validate, api_key=args.api_key,
        discover=getattr(args, "discover", None), kv_events_endpoints=endpoints, kv_events_replay_endpoints=replays,
        kv_events_port=args.kv_events_port, kv_events_replay_port=args.kv_events_replay_port,
        kv_events_topic=args.kv_events_topic,
    )  # fmt: skip


def _router(args) -> int:
    import uvicorn

    from fulcrum.router.app import Router, build_app
    from fulcrum.router.pool import Pool

    if args.prefill or args.decode:
        app = build_app(_pd_router(args), ui=args.ui)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        return 0
    if not args.replica and not args.discover:
        raise SystemExit("fulcrum router: give --replica URL (one or more) or --discover HOST:PORT")
    pool = Pool(args.replica or [], interval=args.scrape_interval, stale_after=args.stale_after)
    app = build_app(Router(pool, router_config(args)), ui=args.ui)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _pd_router(args):
    """pd mode (fulcrum/router/pd.py): prefill engines and decode engines, each pool routed by --policy."""
    from fulcrum.router.pd import PDConfig, PDRouter
    from fulcrum.router.pool import Pool

    if not (args.prefill and args.decode) or args.replica or args.discover:
        raise SystemExit("fulcrum router: pd mode takes --prefill URL and --decode URL (one or more each), "
                         "without --replica or --discover")  # fmt: skip
    pools = [Pool(urls, interval=args.scrape_interval, stale_after=args.stale_after)
             for urls in (args.prefill, args.decode)]  # fmt: skip
    pd = PDConfig(min_prompt_tokens=args.pd_min_prompt_tokens, max_prefill_load=args.pd_max_prefill_load)
    return PDRouter(*pools, router_config(args), pd)


def add_router_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("router", help="route OpenAI-compatible requests over many replicas (cache- and load-aware)")
    p.add_argument("--replica", action="append", default=[], metavar="URL", help="a replica (repeat for each)")
    p.add_argument("--discover", default=None, metavar="HOST:PORT", help="replicas from DNS (a headless Service)")
    g = p.add_argument_group("prefill/decode disaggregation (pd mode)")
    g.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill engine (fulcrum serve --kv-role producer; repeat for each)")  # fmt: skip
    g.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode engine (fulcrum serve --kv-role consumer; repeat for each)")  # fmt: skip
    g.add_argument("--pd-min-prompt-tokens", type=int, default=32,
                   help="shorter prompts skip the prefill engines: the decode engine prefills them itself")  # fmt: skip
    g.add_argument("--pd-max-prefill-load", type=float, default=None,
                   help="when the least-loaded prefill engine has more requests than this, decode engines prefill")  # fmt: skip
    add_routing_args(p)
    p.set_defaults(func=_router)
    return p


def add_scaling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("autoscaling")
    g.add_argument("--min", dest="min_replicas", type=int, default=1)
    g.add_argument("--max", dest="max_replicas", type=int, default=4)
    g.add_argument("--slo", default="", help="latency targets, e.g. ttft=500ms,itl=0.1 (seconds unless ms)")
    g.add_argument("--percentile", type=float, default=0.9, help="the SLO holds at this quantile (0-1)")
    g.add_argument("--target-concurrency", type=float, default=4.0, help="requests in flight per replica")
    g.add_argument("--stable-window", type=float, default=60.0, help="seconds of concurrency averaged to size the pool")
    g.add_argument("--panic-window", type=float, default=6.0, help="seconds averaged to react to a burst")
    g.add_argument("--panic-threshold", type=float, default=2.0, help="panic at this many times the current pool")
    g.add_argument("--tick", type=float, default=1.0, help="seconds between decisions")
    g.add_argument(
        "--drain-timeout", type=non_negative_seconds, default=60.0, help="seconds a scale-down waits for in-flight work"
    )
    g.add_argument("--kv-usage-limit", type=float, default=0.9,
                   help="the replicas' mean KV-cache usage over the panic window above this adds a replica")  # fmt: skip


def scaler_config(args):
    from fulcrum.router.autoscaler import ScalerConfig, parse_slo

    try:
        slo = parse_slo(args.slo, args.percentile)
    except ValueError as e:
        raise SystemExit(f"fulcrum autoscale: {e}") from None
    return ScalerConfig(
        min_replicas=args.min_replicas, max_replicas=args.max_replicas, target_concurrency=args.target_concurrency,
        stable_window=args.stable_window, panic_window=args.panic_window, panic_threshold=args.panic_threshold,
        tick=args.tick, drain_timeout=args.drain_timeout, slo=slo, kv_usage_limit=args.kv_usage_limit,
    )  # fmt: skip


def make_backend(args, router_cfg=None):
    """`router_cfg`: where a local backend writes each replica's KV-events endpoints (kv-events policy)."""
    serve_args = [a for arg in args.serve_arg for a in shlex.split(arg)]
    if args.backend == "ray":
        from fulcrum.router.ray_backend import RayBackend

        return RayBackend(args.model_pos, serve_args, address=args.ray_address, num_cpus=args.ray_num_cpus)
    from fulcrum.router.backends import LocalBackend

    events = None
    if router_cfg is not None and router_cfg.uses_kv_events and router_cfg.kv_events_port is None:
        events = (router_cfg.kv_events_endpoints, router_cfg.kv_events_replay_endpoints)
    return LocalBackend(args.model_pos, serve_args, log_dir=args.log_dir, drain_timeout=args.drain_timeout,
                        kv_events=events)  # fmt: skip


def _autoscale(args) -> int:
    import uvicorn

    from fulcrum.router.app import Router, build_app
    from fulcrum.router.autoscaler import Autoscaler
    from fulcrum.router.pool import Pool

    cfg = scaler_config(args)
    pool = Pool([], interval=args.scrape_interval, stale_after=args.stale_after)
    if args.model is None and args.policy in ("prefix", "kv-events", "weighted"):
        args.model = args.model_pos
    if args.policy == "kv-events" and args.backend == "ray" and args.kv_events_port is None:
        raise SystemExit("fulcrum autoscale: --backend ray with --policy kv-events needs --kv-events-port, and each "
                         "replica's --serve-arg '--kv-events-config ...' on that port (one replica per node)")  # fmt: skip
    router = Router(pool, router_config(args, backend_events=args.backend == "local"))
    autoscaler = Autoscaler(pool, make_backend(args, router.cfg), cfg)
    uvicorn.run(build_app(router, autoscaler, ui=args.ui), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_autoscale_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("autoscale", help="the router over a pool of replicas it starts and stops to hold an SLO")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="model folder the replicas serve (default: bundled)")
    p.add_argument("--backend", choices=["local", "ray"], default="local")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARGS",
                   help="arguments for each `fulcrum serve` (repeatable, shell-split)")  # fmt: skip
    p.add_argument("--log-dir", default=None, help="local backend: write each replica's log here")
    p.add_argument("--ray-address", default=None, help="ray backend: the cluster (default: start or join a local one)")
    p.add_argument("--ray-num-cpus", type=float, default=1.0, help="ray backend: CPUs each replica actor reserves")
    add_routing_args(p)
    add_scaling_args(p)
    p.set_defaults(func=_autoscale)
    return p


def _deploy_k8s(args) -> int:
    from fulcrum.router.k8s import K8sConfig, render, to_yaml

    cfg = K8sConfig(
        name=args.name, namespace=args.namespace, image=args.image, model=args.model,
        serve_args=[a for arg in args.serve_arg for a in shlex.split(arg)], replicas=args.replicas,
        min_replicas=args.min_replicas, max_replicas=args.max_replicas, policy=args.policy, scaler=args.scaler,
        target_waiting=args.target_waiting, prometheus=args.prometheus, cpu=args.cpu, memory=args.memory,
        gpus=args.gpus, drain_timeout=args.drain_timeout, models_claim=args.models_claim or None,
    )  # fmt: skip
    text = to_yaml(render(cfg))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0


def add_deploy_parser(sub) -> argparse.ArgumentParser:
    d = sub.add_parser("deploy", help="render the fleet (replicas, router, autoscaling) for a cluster")
    verbs = d.add_subparsers(dest="deploy_verb", required=True)
    k = verbs.add_parser("k8s", help="Kubernetes manifests: replica Deployment + Service, router, HPA or KEDA")
    k.add_argument("--name", default="fulcrum")
    k.add_argument("--namespace", default=None)
    k.add_argument(
        "--image", default=None,
        help="an image with fulcrum installed (default: what `make image-cpu` builds, or `make image-cuda` with --gpus)",
    )  # fmt: skip
    k.add_argument("--model", default="/models/model", help="the model as the container sees it")
    k.add_argument(
        "--models-claim", default="fulcrum-models",
        help="a PersistentVolumeClaim holding the models, mounted read-only at /models in every pod ('' for none: a "
        "model inside the image)",
    )  # fmt: skip
    k.add_argument("--serve-arg", action="append", default=[], metavar="ARGS", help="for each `fulcrum serve`")
    k.add_argument("--replicas", type=int, default=1)
    k.add_argument("--min", dest="min_replicas", type=int, default=1)
    k.add_argument("--max", dest="max_replicas", type=int, default=4)
    k.add_argument("--policy", choices=sorted(POLICIES), default="prefix")
    k.add_argument("--scaler", choices=["hpa", "keda", "none"], default="hpa")
    k.add_argument("--target-waiting", type=float, default=4.0, help="waiting requests per replica to scale on")
    k.add_argument("--prometheus", default="http://prometheus.monitoring:9090", help="KEDA's Prometheus")
    k.add_argument("--cpu", default="4")
    k.add_argument("--memory", default="16Gi")
    k.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu per replica")
    k.add_argument("--drain-timeout", type=int, default=30)
    k.add_argument("-o", "--output", default=None, help="write here (default: stdout)")
    k.set_defaults(func=_deploy_k8s)
    return d


def add_router_parsers(sub) -> None:
    """Every verb of this package: router, autoscale, deploy."""
    add_router_parser(sub)
    add_autoscale_parser(sub)
    add_deploy_parser(sub)
