"""Multi-LoRA offline (`LLM.generate(..., lora_request=...)`): adapters made by PEFT on a tiny random Qwen3 (random A and
B, different ranks and targets: q/v, all seven projections, o/down) give the greedy tokens of PEFT's merged model in
transformers, alone and in one batch mixing three adapters and the base, for short prompts (each token's matrices
gathered) and long ones (tokens grouped by adapter); with fewer slots than adapters the step waits and swaps; prefix
blocks are never shared across adapters; bad adapters are refused by name and the engine goes on serving."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fulcrum.engine.llm import LLM
from fulcrum.engine.lora import LoRARequest
from fulcrum.errors import InvalidRequestError
from fulcrum.models.lora import LoRAError
from fulcrum.sampling_params import SamplingParams
from tests.tiny_models import hf_model, save_tiny_model

SHORT = [5, 17, 300, 42, 9, 77, 123]
LONG = [(i * 37 + 11) % 2000 + 3 for i in range(90)]  # above the gathered path's 64 tokens: grouped by adapter
TARGETS = [
    (["q_proj", "v_proj"], 8, False),
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16, False),
    (["o_proj", "down_proj"], 4, True),  # rsLoRA's scaling
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def make_adapter(base, folder, targets, r, rslora=False, seed=0, **extra):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, use_rslora=rslora,
                     **extra)  # fmt: skip
    model = get_peft_model(hf_model(base), cfg)
    with torch.no_grad():  # random A and B (B is not zero), scaled so the adapter moves the tokens but not wildly
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    model.save_pretrained(folder)
    return folder


# qwen3 runs its decode steps on the layer modules (q/k norms), qwen2 on the fused CPU decode stack, whose LoRA is
# kernels/csrc/decode_stack.cpp's
@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def base_and_adapters(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = save_tiny_model(request.param, root / "base")
    adapters = [make_adapter(base, root / f"a{i}", t, r, rs, seed=100 + i) for i, (t, r, rs) in enumerate(TARGETS)]
    return base, adapters


def merged_tokens(base, adapter, prompt, n=10) -> list[int]:
    from peft import PeftModel

    model = hf_model(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def references(base_and_adapters):
    base, adapters = base_and_adapters
    return {(i, len(p)): merged_tokens(base, a, p) for i, a in enumerate([None, *adapters]) for p in (SHORT, LONG)}


def requests(adapters) -> list[LoRARequest | None]:
    return [None, *(LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters))]


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
def test_mixed_batch_and_alone_equal_peft_merged(base_and_adapters, references, prompt):
    base, adapters = base_and_adapters
    lrs = requests(adapters)
    want = [references[(i, len(prompt))] for i in range(len(lrs))]
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
             kv_cache_memory=2**24) as llm:  # fmt: skip
        batch = llm.generate([{"prompt_token_ids": prompt}] * len(lrs), GREEDY, lora_request=lrs, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in batch] == want
        assert references[(1, len(prompt))] != references[(0, len(prompt))]  # the adapters do change the tokens
        for lr, w in zip(lrs, want):
            alone = llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=lr, use_tqdm=False)
            assert alone[0].outputs[0].token_ids == w
        assert sorted(llm.list_loras()) == ["a0", "a1", "a2"]
        stack = llm.core.runner.model.model._stack
        if "qwen2" in str(base):  # its decode steps, adapters and all, ran in the fused stack
            assert stack and stack.lora_rank == 16


def test_fewer_slots_than_adapters_swaps_between_steps(base_and_adapters, references):
    base, adapters = base_and_adapters
    lrs = requests(adapters) * 2
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16,
             kv_cache_memory=2**24) as llm:  # fmt: skip
        out = llm.generate([{"prompt_token_ids": SHORT}] * len(lrs), GREEDY, lora_request=lrs, use_tqdm=False)
        stats = llm.core.runner.lora.stats()
    assert [o.outputs[0].token_ids for o in out] == [references[(i % 4, len(SHORT))] for i in range(len(lrs))]
    assert stats["lora_evictions"] >= 2  # one slot for three adapters: they took turns


def test_prefix_blocks_are_kept_apart_by_adapter(base_and_adapters):
    base, adapters = base_and_adapters
    a0, a1 = requests(adapters)[1:3]
    prompt = {"prompt_token_ids": LONG}
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=16, kv_cache_memory=2**24) as llm:

        def hits_after(lr) -> int:
            before = llm.stats()["prefix_cache_hits"]
            llm.generate([prompt], GREEDY, lora_request=lr, use_tqdm=False)
            return llm.stats()["prefix_cache_hits"] - before

        assert hits_after(a0) == 0
        assert hits_after(a1) == 0  # another adapter: none of a0's blocks
        assert hits_after(None) == 0  # the base model: none either
        assert hits_after(a1) >= 64  # the same adapter again: its blocks
        assert hits_after(None) >= 64


def test_bad_adapters_are_refused_by_name_and_the_engine_goes_on(base_and_adapters, references, tmp_path):
    base, adapters = base_and_adapters
    other_base = save_tiny_model("qwen3", tmp_path / "other", hidden_size=96, head_dim=24)
    wrong_shape = make_adapter(other_base, tmp_path / "wrong", ["q_proj"], 4)
    too_big = make_adapter(base, tmp_path / "big", ["q_proj"], 32)
    embed = make_adapter(base, tmp_path / "embed", ["q_proj", "embed_tokens"], 4)
    dora = tmp_path / "dora"
    shutil.copytree(adapters[0], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=16, kv_cache_memory=2**24) as llm:
        llm.add_lora(LoRARequest("a0", 1, str(adapters[0])))
        cases = [
            (LoRARequest("w", 2, str(wrong_shape)), "another base model"),
            (LoRARequest("b", 3, str(too_big)), "above --max-lora-rank 16"),
            (LoRARequest("e", 4, str(embed)), "embed_tokens"),
            (LoRARequest("d", 5, str(dora)), "use_dora"),
            (LoRARequest("m", 6, str(tmp_path / "missing")), "adapter_config.json"),
            (LoRARequest("a0", 7, str(adapters[1])), "already loaded"),
        ]
        for lr, message in cases:
            with pytest.raises(LoRAError, match=message):
                llm.add_lora(lr)
        assert llm.list_loras() == ["a0"]
        out = llm.generate([{"prompt_token_ids": SHORT}], GREEDY, lora_request=requests(adapters)[1], use_tqdm=False)
        assert out[0].outputs[0].token_ids == references[(1, len(SHORT))]
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'nope'"):
            llm.remove_lora("nope")


def test_unloading_waits_for_its_requests(base_and_adapters, references):
    base, adapters = base_and_adapters
    lr = requests(adapters)[2]
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=16, kv_cache_memory=2**24) as llm:
        llm.add_lora(lr)
        rid = llm.add_request(None, SHORT, GREEDY, lora_request=lr)
        llm.step()  # running now
        with pytest.raises(InvalidRequestError, match="1 request"):
            llm.remove_lora("a1")
        done = None
        while done is None:
            done = next((ro for ro, _ in llm.step() if ro.request_id == rid and ro.finished), None)
        assert done.outputs[0].token_ids == references[(2, len(SHORT))]  # not broken by the refused unload
        llm.remove_lora("a1")
        assert llm.list_loras() == []


def test_a_lora_request_needs_an_engine_with_lora(base_and_adapters):
    base, adapters = base_and_adapters
    with LLM(str(base), dtype="float32", kv_cache_memory=2**24) as llm, pytest.raises(InvalidRequestError):
        llm.generate([{"prompt_token_ids": SHORT}], GREEDY, lora_request=requests(adapters)[1], use_tqdm=False)


def test_data_parallel_cores_load_and_refuse_alike(base_and_adapters, references):
    """Two engine-core processes: an adapter answers as PEFT's merge on both; a refused load names its field and a
    name already taken leaves the loaded adapter in place on every core."""
    base, adapters = base_and_adapters
    lr = requests(adapters)[1]
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=16, kv_cache_memory=2**24,
             data_parallel_size=2) as llm:  # fmt: skip
        llm.add_lora(lr)
        with pytest.raises(LoRAError) as taken:
            llm.add_lora(LoRARequest("a0", 9, str(adapters[1])))
        assert taken.value.param == "lora_name"
        with pytest.raises(LoRAError) as missing:
            llm.add_lora(LoRARequest("m", 10, "/nonexistent/adapter"))
        assert missing.value.param == "lora_path"
        assert llm.list_loras() == ["a0"]
        out = llm.generate([{"prompt_token_ids": SHORT}] * 4, GREEDY, lora_request=lr, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [references[(1, len(SHORT))]] * 4
