"""`fulcrum serve --config FILE` and `fulcrum generate --config FILE`: a YAML or JSON mapping of the command's flags,
read as if given first on the command line (which overrides it)."""

import json
import subprocess
import sys
import urllib.request

import pytest

from fulcrum.cli import build_parser, main
from fulcrum.utils.config_file import ConfigFileError, expand_argv, read_config, write_config
from fulcrum.utils.serve_process import start


def parse(verb, config, *argv):
    parser = build_parser()
    return parser.parse_args(expand_argv(parser, [verb, "--config", str(config), *argv]))


def test_keys_with_dashes_underscores_or_leading_dashes(tmp_path):
    path = write_config(tmp_path / "c.yaml", {"max-num-seqs": 4, "max_num_batched_tokens": 512, "--block-size": 32})
    args = parse("serve", path)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.block_size) == (4, 512, 32)
    assert args.config == str(path)


def test_switches_lists_and_json_valued_flags(tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    path = tmp_path / "c.yaml"
    path.write_text(
        "prompt: Hi\nignore-eos: true\nno-prefix-caching: false\nstop: [a, '-b']\n"
        f"speculative-config: {json.dumps(spec)}\n"
        'kv-events-config: \'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'\n'
        "kv-transfer-config: {kv_connector: ZmqConnector, kv_role: kv_producer}\nseed: -1\nquantization: null\n"
    )
    args = parse("generate", path)
    assert args.prompt == "Hi" and args.ignore_eos and not args.no_prefix_caching
    assert args.stop == ["a", "-b"] and args.seed == -1 and args.quantization is None
    assert args.speculative_config == spec
    assert args.kv_events_config["endpoint"] == "tcp://*:5557"
    assert args.kv_transfer_config == {"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}


def test_the_command_line_overrides_the_file(tmp_path):
    path = write_config(tmp_path / "c.json", {"model": "from-file", "max-num-seqs": 4, "port": 1})
    args = parse("serve", path, "--max-num-seqs", "8", "--port=2")
    assert (args.model, args.max_num_seqs, args.port) == ("from-file", 8, 2)
    path = write_config(tmp_path / "g.yaml", {"prompt": "Hi", "stop": ["a", "b"], "max-tokens": 3})
    assert parse("generate", path).stop == ["a", "b"]
    assert parse("generate", path, "--stop", "c").stop == ["c"]  # a repeatable flag's list is replaced, not extended
    assert parse("generate", path, "--max-tok", "5").max_tokens == 5  # argparse's abbreviations are seen too


def test_serve_model_positional_overrides_the_files_model(tmp_path):
    path = write_config(tmp_path / "c.yml", {"model": "from-file"})
    args = parse("serve", path, "on-the-command-line")
    assert args.model == "from-file" and args.model_pos == "on-the-command-line"  # _serve takes model_pos first


@pytest.mark.parametrize(
    "text, said",
    [
        ("max-num-seq: 4\n", ["max-num-seq", "takes no --max-num-seq", "did you mean max-num-seqs"]),
        ("prompt: Hi\n", ["prompt", "fulcrum serve"]),  # a flag of generate's, not serve's
        ("max-num-seqs: lots\n", ["max-num-seqs", "invalid int value"]),
        ("max-num-seqs: [1, 2]\n", ["max-num-seqs", "one value, not a list"]),
        ("no-prefix-caching: 1\n", ["no-prefix-caching", "true or false"]),
        ("served-model-name: no\n", ["served-model-name", "not false"]),  # YAML's `no`
        ("kv-cache-dtype: fp4\n", ["kv-cache-dtype", "invalid choice"]),
        ("speculative-config: {method: magic}\n", ["speculative-config", "magic"]),
        ("max-num-seqs: 4\nmax_num_seqs: 5\n", ["max_num_seqs", "same flag as max-num-seqs"]),
        ("config: other.yaml\n", ["config", "cannot be set"]),
        ("help: true\n", ["help", "cannot be set"]),
        ("- max-num-seqs\n", ["not a mapping"]),
        ("max-num-seqs: [1\n", ["not valid YAML", "line 2"]),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_and_key(tmp_path, capsys, text, said):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["serve", "--port", "0", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: "), err
    for s in said:
        assert s in err, (s, err)


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigFileError, match="missing.yaml: cannot read"):
        read_config(tmp_path / "missing.yaml")
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ConfigFileError, match=r"c.toml: a config file is \.json, \.yaml or \.yml"):
        read_config(tmp_path / "c.toml")
    (tmp_path / "c.json").write_text("{max-num-seqs: 4}")
    with pytest.raises(ConfigFileError, match="c.json: not valid JSON"):
        read_config(tmp_path / "c.json")
    (tmp_path / "empty.yaml").write_text("")
    assert read_config(tmp_path / "empty.yaml") == {}


def test_write_config_round_trips(tmp_path):
    flags = {
        "max_num_seqs": 4,
        "--kv-cache-memory": 0.05,
        "enforce-eager": True,
        "no-chunked-prefill": False,
        "served-model-name": "on",  # a string YAML would otherwise read as true
        "speculative-config": {"method": "ngram", "num_speculative_tokens": 2},
        "quantization": None,
    }
    for name in ("t.json", "t.yaml"):
        path = write_config(tmp_path / name, flags)
        assert "max-num-seqs" in read_config(path)
        args = parse("serve", path)
        assert (args.max_num_seqs, args.kv_cache_memory, args.enforce_eager) == (4, 0.05, True)
        assert args.served_model_name == "on" and not args.no_chunked_prefill and args.quantization is None
        assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}


def test_other_verbs_and_no_config_are_unchanged():
    parser = build_parser()
    for argv in (["serve", "--port", "1"], ["bench", "serve"], ["--help"], [], ["serve", "--config"]):
        assert expand_argv(parser, argv) == argv


def test_generate_with_a_config_file(tmp_path):
    path = write_config(
        tmp_path / "gen.yaml",
        {"prompt": "ROMEO:", "max-tokens": 3, "ignore-eos": True, "kv-cache-memory": 0.05, "max-num-seqs": 2},
    )
    cmd = [sys.executable, "-m", "fulcrum.cli", "generate", "--config", str(path), "--max-tokens", "5"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ROMEO:")  # the file's prompt
    assert "[5 tokens in" in res.stderr  # the command line's --max-tokens over the file's 3


def test_serve_with_a_config_file(tmp_path):
    path = write_config(
        tmp_path / "tuned.yaml", {"served-model-name": "tuned", "max-num-seqs": 4, "kv-cache-memory": 0.05}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with start(None, "--config", str(path), log_path=tmp_path / "server.log", timeout=120) as server:
        models = json.loads(opener.open(f"{server.url}/v1/models", timeout=10).read())
    assert [m["id"] for m in models["data"]] == ["tuned"]
