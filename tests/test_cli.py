"""`fulcrum generate` and `fulcrum serve` as a user runs them: a subprocess, the bundled model, what it prints."""

import shutil
import socket
import subprocess
import sys
import time

from fulcrum.config import DEFAULT_MODEL


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


def test_generate_top_k_above_the_vocabulary_runs():
    res = run(
        "--prompt", "Hi", "--top-k", "5000", "--temperature", "1", "--max-tokens", "5", "--kv-cache-memory", "0.05"
    )
    assert res.returncode == 0, res.stderr
    assert "5 tokens in" in res.stderr


def test_generate_names_an_out_of_range_seed():
    res = run("--prompt", "Hi", "--min-tokens", "2", "--sample-seed", str(2**64))
    assert res.returncode == 2 and "seed" in res.stderr and "Traceback" not in res.stderr


def test_serve_refuses_a_negative_drain_timeout_before_loading():
    for bad in ("-1", "nan", "soon"):
        res = subprocess.run(
            [sys.executable, "-m", "fulcrum.cli", "serve", "--drain-timeout", bad], capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert res.returncode == 2 and "--drain-timeout" in res.stderr and "Traceback" not in res.stderr


def test_serve_on_a_taken_port_fails_at_once_without_loading_the_model(tmp_path):
    # weights that cannot load: an error about the port, not about the weights, shows the port came first
    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    (model / "model.safetensors").write_bytes(b"not safetensors")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        res = subprocess.run(
            [sys.executable, "-m", "fulcrum.cli", "serve", str(model), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert res.returncode != 0
    assert f"error: port {port} on 127.0.0.1 is already in use; pick another with --port" in res.stderr
    assert "safetensors" not in res.stderr and "fulcrum serving" not in res.stdout
    assert time.monotonic() - t0 < 30  # the time to start Python and import torch, no more


def test_the_client_verbs_start_without_the_engines_libraries():
    # `fulcrum bench serve`, `plan` and `router` are clients or arithmetic: building the command line must not import
    # torch or transformers (3-6 s on a small VM before a load generator sends its first request)
    code = (
        "import sys; from fulcrum.cli import build_parser; build_parser().parse_args(['bench', 'serve']); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_serve_answers_a_bad_model_in_one_line(tmp_path):
    """Issue 37: a missing folder, a folder without a tokenizer, a truncated checkpoint (the engine core fails) and
    a bad flag each end with one line and exit 2, as `fulcrum generate` answers; no traceback."""
    broken = tmp_path / "truncated"
    shutil.copytree(DEFAULT_MODEL, broken)
    weights = sorted(broken.glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[:10_000])
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    cases = [
        ([str(tmp_path / "missing")], "not a model folder"),
        ([str(no_tokenizer)], "no tokenizer"),
        ([str(broken)], "the engine core failed to start"),
        (["--max-num-seqs", "-3"], "max_num_seqs"),
    ]
    for args, said in cases:
        res = subprocess.run(
            [sys.executable, "-m", "fulcrum.cli", "serve", "--port", "0", "--kv-cache-memory", "0.05", *args],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert res.returncode == 2 and "Traceback" not in res.stderr, (args, res.stderr[-2000:])
        assert len(errors) == 1 and said in errors[0], (args, res.stderr[-2000:])


def test_serve_on_cpu_takes_the_cpu_step_budget_unless_one_is_given():
    from fulcrum.cli import build_parser, engine_kwargs
    from fulcrum.config import EngineConfig
    from fulcrum.defaults import DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_BATCHED_TOKENS

    def budget(*argv, serving=True):
        args = build_parser().parse_args(["serve", *argv])
        return EngineConfig(**engine_kwargs(args, serving=serving)).max_num_batched_tokens

    assert DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS < DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert budget("--device", "cpu") == DEFAULT_CPU_SERVE_MAX_NUM_BATCHED_TOKENS
    assert budget("--device", "cpu", "--max-num-seqs", "1000") == 1000  # every running sequence's decode fits a step
    assert budget("--device", "cpu", "--max-num-batched-tokens", "4096") == 4096  # a budget given is kept
    assert budget("--device", "cuda") == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert budget("--device", "cpu", serving=False) == DEFAULT_MAX_NUM_BATCHED_TOKENS  # generate: the engine's
    assert EngineConfig(device="cpu").max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS  # LLM(...): the same
