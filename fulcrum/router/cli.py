"""`fulcrum router`, `fulcrum autoscale` and `fulcrum deploy k8s`: their arguments, and the runs."""

from __future__ import annotations

import argparse

from fulcrum.router.policies import POLICIES


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


def router_config(args):
    from fulcrum.router.app import RouterConfig

    return RouterConfig(
        policy=args.policy, model=args.model, balance_margin=args.balance_margin, prefix_weight=args.prefix_weight,
        load_weight=args.load_weight, sticky_header=args.sticky_header, sticky_user=args.sticky_user,
        max_attempts=args.max_attempts, first_token_timeout=args.first_token_timeout,
        request_timeout=args.request_timeout, validate=args.validate, api_key=args.api_key,
        discover=getattr(args, "discover", None),
    )  # fmt: skip


def _router(args) -> int:
    import uvicorn

    from fulcrum.router.app import Router, build_app
    from fulcrum.router.pool import Pool

    if not args.replica and not args.discover:
        raise SystemExit("fulcrum router: give --replica URL (one or more) or --discover HOST:PORT")
    pool = Pool(args.replica or [], interval=args.scrape_interval, stale_after=args.stale_after)
    app = build_app(Router(pool, router_config(args)))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_router_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("router", help="route OpenAI-compatible requests over many replicas (cache- and load-aware)")
    p.add_argument("--replica", action="append", default=[], metavar="URL", help="a replica (repeat for each)")
    p.add_argument("--discover", default=None, metavar="HOST:PORT", help="replicas from DNS (a headless Service)")
    add_routing_args(p)
    p.set_defaults(func=_router)
    return p


def add_router_parsers(sub) -> None:
    """Every verb of this package: router, autoscale, deploy."""
    add_router_parser(sub)
