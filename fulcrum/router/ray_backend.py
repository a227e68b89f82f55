"""The `ray` backend: each replica is a Ray actor that runs one `fulcrum serve` process on the node Ray placed
it on (bound to that node's IP), so that the fleet spans a cluster. The model path must be readable on every
node. Needs the `ray` extra: pip install 'fulcrum[ray]'."""

from __future__ import annotations

import functools

from fulcrum.router.backends import launch, terminate


@functools.cache
def _actor_class():
    import ray

    @ray.remote
    class ReplicaActor:
        def start(self, model, serve_args, timeout, host=None):
            host = host or ray.util.get_node_ip_address()
            self.proc, url = launch(model, serve_args, host, None, timeout)
            return url

        def stop(self, timeout):
            return terminate(self.proc, timeout)

    return ReplicaActor


class RayBackend:
    def __init__(self, model: str | None, serve_args: list[str], address: str | None = None, num_cpus: float = 1.0,
                 start_timeout: float = 300, drain_timeout: float = 60, host: str | None = None):  # fmt: skip
        try:
            import ray
        except ImportError:
            raise SystemExit("the ray backend needs Ray: pip install 'fulcrum[ray]'") from None
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        self.ray = ray
        self.model, self.serve_args, self.num_cpus, self.host = model, serve_args, num_cpus, host
        self.start_timeout, self.drain_timeout = start_timeout, drain_timeout
        self.actors: dict[str, object] = {}

    def start(self) -> str:
        actor = _actor_class().options(num_cpus=self.num_cpus).remote()
        url = self.ray.get(actor.start.remote(self.model, self.serve_args, self.start_timeout, self.host))
        self.actors[url] = actor
        return url

    def stop(self, url: str) -> int:
        actor = self.actors.pop(url)
        code = self.ray.get(actor.stop.remote(self.drain_timeout + 10))  # SIGTERM: the replica drains
        self.ray.kill(actor)
        return code
