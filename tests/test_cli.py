"""`fulcrum generate` as a user runs it: a subprocess, the bundled model, text on stdout."""

import subprocess
import sys


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "fulcrum.cli", "generate", *args], capture_output=True, text=True, timeout=120
    )


def test_generate_streams_the_bundled_model_greedy():
    res = run("--prompt", "ROMEO:", "--max-tokens", "24", "--kv-cache-memory", "0.05")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ROMEO:") and len(res.stdout.strip()) > len("ROMEO:") + 10
    assert "tokens in" in res.stderr
    again = run("--prompt", "ROMEO:", "--max-tokens", "24", "--kv-cache-memory", "0.05")
    assert again.stdout == res.stdout  # greedy is deterministic


def test_generate_rejects_bad_sampling_values():
    res = run("--prompt", "Hi", "--temperature", "-1")
    assert res.returncode == 2 and "temperature" in res.stderr
