"""`fulcrum serve` on CPU takes the CPU server's step budget when none is given, and says so when it is ready."""

from fulcrum.defaults import DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS
from tests.servers import start_server


def test_a_cpu_server_announces_the_cpu_step_budget(tmp_path):
    with start_server(tmp_path, "--device", "cpu") as s:
        assert f"step budget {DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS} tokens" in s.log()
