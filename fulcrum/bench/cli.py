"""Arguments of `fulcrum bench serve` and `fulcrum bench compare`."""

from __future__ import annotations

import argparse


def add_bench_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("bench", help="measure an OpenAI-compatible server: latency, throughput, goodput, cost")
    b.add_subparsers(dest="bench_verb", required=True)
    return b
