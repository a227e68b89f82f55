"""Arguments of `fulcrum plan`."""

from __future__ import annotations

import argparse


def add_plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="memory, GPU count, roofline speed and cost per token for a model on hardware")
    return p
