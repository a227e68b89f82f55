"""Embeddings offline (`LLM.embed`): tiny random models saved by sentence-transformers in Qwen3-Embedding's layout
(a bare Qwen3 backbone, a Pooling module, Normalize) give the vectors sentence-transformers gives, for last-token,
mean and CLS pooling, whole or with the prompt in chunks; 64 inputs run in one scheduler pass; a generative model
refuses embeddings and an embedding model refuses generation; dimensions only on a matryoshka model."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from fulcrum.engine.llm import LLM
from fulcrum.errors import InvalidRequestError, ModelLoadError
from fulcrum.sampling_params import PoolingParams, SamplingParams
from tests.tiny_models import hf_model, save_tiny_embedding_model

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "a",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
]
LONG = " ".join(["the slings and arrows of outrageous fortune, or to take arms against a sea of troubles"] * 4)


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    """(folder, pooling) -> a saved sentence-transformers model, built once."""
    made = {}

    def get(pooling: str, normalize: bool = True):
        key = (pooling, normalize)
        if key not in made:
            made[key] = save_tiny_embedding_model(tmp_path_factory.mktemp(f"st-{pooling}") / "m", pooling, normalize)
        return made[key]

    return get


def reference(folder, texts) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True, batch_size=8)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_vectors_equal_sentence_transformers(st_model, pooling):
    folder = st_model(pooling)
    ref = reference(folder, [*TEXTS, LONG])
    # a small step budget puts the long prompt in several chunks: its pooling spans steps
    with LLM(str(folder), dtype="float32", max_num_batched_tokens=32, kv_cache_memory=2**24) as llm:
        assert llm.core.model_config.task == "embed"  # found from modules.json, no flag
        out = llm.embed([*TEXTS, LONG], use_tqdm=False)
    got = np.array([o.outputs.embedding for o in out])
    assert got.shape == ref.shape
    assert cosines(got, ref).min() > 1 - 1e-4
    np.testing.assert_allclose(got, ref, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # its Normalize module


def test_without_normalize_the_vector_is_the_raw_mean(st_model):
    folder = st_model("mean", normalize=False)
    ref = reference(folder, TEXTS)
    with LLM(str(folder), dtype="float32", kv_cache_memory=2**24) as llm:
        got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        # a request may still ask for normalisation
        unit = np.array([o.outputs.embedding for o in llm.embed(TEXTS, PoolingParams("mean", True), use_tqdm=False)])
    np.testing.assert_allclose(got, ref, atol=1e-4)
    assert np.abs(np.linalg.norm(got, axis=1) - 1).max() > 1e-2
    np.testing.assert_allclose(unit, ref / np.linalg.norm(ref, axis=1, keepdims=True), atol=1e-5)


def test_64_inputs_are_one_scheduler_pass(st_model):
    folder = st_model("last")
    texts = [f"document number {i} about {'cats' if i % 2 else 'dogs'}" for i in range(64)]
    with LLM(str(folder), dtype="float32", kv_cache_memory=2**24) as llm:
        steps = []
        schedule = llm.core.scheduler.schedule

        def counted():
            out = schedule()
            if out.scheduled:
                steps.append(len(out.scheduled))
            return out

        llm.core.scheduler.schedule = counted
        out = llm.embed(texts, use_tqdm=False)
        assert steps == [64]
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]  # every block given back
    np.testing.assert_allclose(np.array([o.outputs.embedding for o in out]), reference(folder, texts), atol=1e-4)


def test_task_embed_on_a_causal_lm_pools_its_last_hidden_state(tiny_model_dir):
    folder = tiny_model_dir("qwen3")
    ids = [5, 17, 300, 42, 9]
    with torch.no_grad():
        hidden = hf_model(folder)(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    with LLM(str(folder), dtype="float32", kv_cache_memory=2**24, task="embed") as llm:
        last = np.array(llm.embed([ids], use_tqdm=False)[0].outputs.embedding)
        mean = np.array(llm.embed([ids], PoolingParams("mean", False), use_tqdm=False)[0].outputs.embedding)
        with pytest.raises(InvalidRequestError, match="serves embeddings"):
            llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    np.testing.assert_allclose(last, torch.nn.functional.normalize(hidden[-1], dim=0).numpy(), atol=1e-5)
    np.testing.assert_allclose(mean, hidden.mean(0).numpy(), atol=1e-5)


def test_a_generative_model_refuses_embeddings(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("qwen3")), dtype="float32", kv_cache_memory=2**24)
    with llm, pytest.raises(InvalidRequestError, match="--task embed"):
        llm.embed(["hello"], use_tqdm=False)


def test_dimensions_only_on_a_matryoshka_model(st_model, tmp_path):
    folder = st_model("last")
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=2**24)
    with llm, pytest.raises(InvalidRequestError, match="matryoshka"):
        llm.embed(TEXTS, PoolingParams("last", True, 16), use_tqdm=False)
    # the same model declared matryoshka: the leading 16 dimensions, normalised again
    mrl = tmp_path / "mrl"
    shutil.copytree(folder, mrl)
    cfg = json.loads((mrl / "config.json").read_text())
    (mrl / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32, 64]}))
    ref = reference(folder, TEXTS)
    with LLM(str(mrl), dtype="float32", kv_cache_memory=2**24) as llm:
        got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, PoolingParams("last", True, 16), False)])
        with pytest.raises(InvalidRequestError, match=r"one of \[16, 32, 64\]"):
            llm.embed(TEXTS, PoolingParams("last", True, 8), use_tqdm=False)
    cut = ref[:, :16] / np.linalg.norm(ref[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(got, cut, atol=1e-4)


def test_a_module_fulcrum_does_not_run_is_refused_by_name(st_model, tmp_path):
    folder = tmp_path / "dense"
    shutil.copytree(st_model("mean"), folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="sentence_transformers.models.Dense"):
        LLM(str(folder), dtype="float32", kv_cache_memory=2**24)


def test_async_scheduling_and_a_prompt_in_chunks(st_model):
    """With --async-scheduling an embedding step runs synchronously (it reads the prompt's hidden states); a prompt
    longer than the step budget is pooled over several steps, with every block given back at the end."""
    folder = st_model("mean")
    with LLM(str(folder), dtype="float32", kv_cache_memory=2**24, async_scheduling=True,
             max_num_batched_tokens=16) as llm:  # fmt: skip
        out = llm.embed([LONG, *TEXTS], use_tqdm=False)
        stats = llm.stats()
    np.testing.assert_allclose(np.array([o.outputs.embedding for o in out]), reference(folder, [LONG, *TEXTS]),
                               atol=1e-4)  # fmt: skip
    assert stats["num_free_blocks"] == stats["num_blocks"]
