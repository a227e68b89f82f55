"""Cost per token from an hourly price: one formula shared by `fulcrum bench` and `fulcrum plan`."""

from __future__ import annotations


def cost_per_million_tokens(price_per_hour: float, tokens_per_second: float, replicas: int = 1) -> float | None:
    """Dollars per 1M tokens when `replicas` machines at `price_per_hour` each together sustain `tokens_per_second`."""
    if tokens_per_second <= 0:
        return None
    return price_per_hour * replicas / (tokens_per_second * 3600.0) * 1e6
