"""The autoscaler's ray backend on a local Ray cluster started by the test on 127.0.0.1: the same step of load as
the local backend's test, each replica a Ray actor running fulcrum serve. Skipped without the `ray` extra."""

from __future__ import annotations

import pytest

from tests.router.test_autoscaler import SERVE_ARGS, replica_pythonpath, step_load
from tests.servers import MODEL


@pytest.mark.slow
def test_ray_backend_scales_up_under_a_step_and_down_after(monkeypatch):
    """A local Ray cluster on 127.0.0.1, started by the test; each replica a Ray actor running fulcrum serve."""
    ray = pytest.importorskip("ray")
    replica_pythonpath(monkeypatch)
    from fulcrum.router.ray_backend import RayBackend

    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        step_load(RayBackend(str(MODEL), SERVE_ARGS, num_cpus=1, drain_timeout=30, host="127.0.0.1"))
    finally:
        ray.shutdown()
