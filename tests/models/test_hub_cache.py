"""A Hugging Face Hub ID as the model, found in the local Hugging Face cache (never downloaded): the cache here is
laid out as huggingface_hub lays it out (models--org--name/ with blobs/, snapshots/<commit>/ linking to them,
refs/<branch>), and huggingface_hub's own scan_cache_dir must read it as one of its caches."""

import hashlib
import os
import subprocess
import sys

import pytest
import torch
from huggingface_hub import scan_cache_dir

from fulcrum import LLM, SamplingParams
from fulcrum.config import DEFAULT_MODEL, ModelConfig, model_path
from fulcrum.errors import ModelLoadError, ModelNotCachedError
from fulcrum.model_folder import from_gguf
from tests.engine.hf_reference import hf_greedy
from tests.tiny_models import save_tiny_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_in_cache(folder, cache, repo_id, commit=COMMIT, refs=("main",)):
    """Store a model folder as huggingface_hub's downloads do: each file once in blobs/ under its content hash,
    the snapshot of `commit` made of relative links to them, and each ref a file holding the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hub cache that HF_HUB_CACHE points at."""
    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(from_gguf, "gguf_cache_root", lambda: tmp_path / "gguf-cache")
    return root


def test_cache_is_one_huggingface_hub_reads(cache, tmp_path):
    folder = save_tiny_model("llama", tmp_path / "llama")
    put_in_cache(folder, cache, "tiny-org/tiny-llama")
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == "tiny-org/tiny-llama" and repo.repo_type == "model"
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT and revision.refs == frozenset({"main"})
    assert {f.file_name for f in revision.files} == {p.name for p in folder.iterdir()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hub_id_generates_what_the_folder_does(family, cache, tmp_path):
    folder = save_tiny_model(family, tmp_path / family)
    snapshot = put_in_cache(folder, cache, f"tiny-org/tiny-{family}")
    assert model_path(f"tiny-org/tiny-{family}") == snapshot
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(5, 2048, (n,), generator=g).tolist() for n in (4, 31)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def tokens(model):
        llm = LLM(model=model, dtype="float32", kv_cache_memory=16 << 20, seed=0)
        return [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]

    by_id = tokens(f"tiny-org/tiny-{family}")
    assert by_id == tokens(str(folder))
    assert by_id == [hf_greedy(folder, p, 10)[0] for p in batch]


def test_revision_by_branch_tag_or_commit(cache, tmp_path):
    old = save_tiny_model("llama", tmp_path / "old", seed=1)
    new = save_tiny_model("llama", tmp_path / "new", seed=2)
    other = "fedcba9876543210fedcba9876543210fedcba98"
    put_in_cache(old, cache, "tiny-org/m", commit=other, refs=("v1",))
    latest = put_in_cache(new, cache, "tiny-org/m")
    assert model_path("tiny-org/m") == latest
    assert model_path("tiny-org/m@main") == latest
    assert model_path("tiny-org/m@v1").name == other
    assert model_path(f"tiny-org/m@{other}").name == other
    with pytest.raises(ModelNotCachedError, match=r"tiny-org/m@v2 .*at revision 'v2'"):
        model_path("tiny-org/m@v2")


def test_model_not_in_the_cache_names_the_id_and_the_folder_searched(cache):
    with pytest.raises(ModelNotCachedError) as err:
        ModelConfig.from_path("Qwen/Qwen2.5-0.5B-Instruct")
    msg = str(err.value)
    assert "Qwen/Qwen2.5-0.5B-Instruct" in msg and str(cache) in msg and "hf download" in msg


def test_hf_home_is_honoured_without_hf_hub_cache(cache, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snapshot = put_in_cache(save_tiny_model("qwen2", tmp_path / "m"), tmp_path / "home" / "hub", "tiny-org/q")
    assert model_path("tiny-org/q") == snapshot
    with pytest.raises(ModelNotCachedError, match=str(tmp_path / "home" / "hub")):
        model_path("tiny-org/absent")


def test_a_local_folder_comes_before_the_cache(cache, tmp_path, monkeypatch):
    """A path that exists is the model, even when it reads like a Hub ID that the cache also holds."""
    put_in_cache(save_tiny_model("llama", tmp_path / "cached"), cache, "tiny-org/m")
    local = save_tiny_model("qwen2", tmp_path / "tiny-org" / "m")
    monkeypatch.chdir(tmp_path)
    assert model_path("tiny-org/m").resolve() == local
    assert ModelConfig.from_path("tiny-org/m").hf_config.model_type == "qwen2"


def test_a_path_that_is_no_model_says_so(cache, tmp_path):
    with pytest.raises(ModelLoadError, match="not a model folder"):
        model_path(str(tmp_path / "nowhere" / "m"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json not found"):
        model_path(tmp_path / "empty")


def test_a_gguf_repo_in_the_cache(cache, tmp_path):
    """A GGUF repo (one .gguf file, no config.json) loads from the cache like a .gguf path."""
    from tests.models.test_gguf import write_gguf

    folder = save_tiny_model("qwen2", tmp_path / "qwen2")
    repo = tmp_path / "repo"
    repo.mkdir()
    write_gguf(folder, repo / "tiny-qwen2-f32.gguf", "qwen2")
    put_in_cache(repo, cache, "tiny-org/tiny-qwen2-GGUF")
    config = ModelConfig.from_path("tiny-org/tiny-qwen2-GGUF")
    assert config.path.name == "tiny-qwen2-f32" and config.hf_config.architectures == ["Qwen2ForCausalLM"]


def test_fulcrum_generate_takes_a_hub_id(cache):
    """The command line, in a process of its own (where huggingface_hub reads HF_HUB_CACHE at import)."""
    put_in_cache(DEFAULT_MODEL, cache, "fulcrum/tiny-shakespeare")

    def generate(model):
        args = ["--model", model, "--prompt", "ROMEO:", "--max-tokens", "16", "--kv-cache-memory", "0.05"]
        cmd = [sys.executable, "-m", "fulcrum.cli", "generate", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=os.environ.copy())

    by_id = generate("fulcrum/tiny-shakespeare")
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout.startswith("ROMEO:") and "16 tokens in" in by_id.stderr
    missing = generate("fulcrum/absent")
    assert missing.returncode == 2 and "fulcrum/absent" in missing.stderr and str(cache) in missing.stderr
