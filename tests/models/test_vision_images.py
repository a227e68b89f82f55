"""Image prompts on a tiny Qwen2.5-VL (transformers' own classes, saved with its image processor): greedy tokens
equal transformers' `generate` on the same processor output, whole or in prefill chunks; a repeated image is
encoded once; two images never share KV blocks; bad images are refused by name."""

import io

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

from fulcrum.engine.llm import LLM
from fulcrum.errors import InvalidRequestError
from fulcrum.sampling_params import SamplingParams
from tests.tiny_models import save_tiny_model
from tests.tiny_vision import QWEN_IMAGE, hf_vision_model, png, save_tiny_vision_model

PROMPT = "look <|vision_start|><|image_pad|><|vision_end|> and tell me what you see in it"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_vision_model("qwen2_5-vl", tmp_path_factory.mktemp("qwen2_5-vl"))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), dtype="float32", block_size=4)


def image_prompt(*images: bytes, text: str = PROMPT) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


def transformers_tokens(folder, text: str, images: list[bytes], n: int) -> list[int]:
    """transformers' generate on the image processor's output, the placeholders expanded as its processor does."""
    processed = AutoImageProcessor.from_pretrained(folder)(
        images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt"
    )
    parts = text.split("<|image_pad|>")
    counts = [int(g.prod()) // 4 for g in processed["image_grid_thw"]]
    text = parts[0] + "".join("<|image_pad|>" * c + p for c, p in zip(counts, parts[1:]))
    ids = torch.tensor([AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = hf_vision_model(folder).generate(
            ids, mm_token_type_ids=(ids == QWEN_IMAGE).int(), pixel_values=processed["pixel_values"],
            image_grid_thw=processed["image_grid_thw"], max_new_tokens=n, min_new_tokens=n, do_sample=False,
        )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_image_request_greedy_tokens_equal_transformers_generate(folder, llm):
    image = png(1, size=(60, 80))  # 56 x 84 after resizing: 2 x 3 merged patches (M-RoPE's h and w differ)
    out = llm.generate([image_prompt(image)], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids.count(QWEN_IMAGE) == 6
    assert out.outputs[0].token_ids == transformers_tokens(folder, PROMPT, [image], 8)


def test_two_images_in_prefill_chunks_equal_transformers(folder):
    images = [png(2, size=(112, 56)), png(3, size=(56, 56))]
    text = PROMPT + " and <|vision_start|><|image_pad|><|vision_end|> too"
    # 7-token chunks: both images' rows are split between chunks
    chunked = LLM(str(folder), dtype="float32", max_num_batched_tokens=7, block_size=4, enable_chunked_prefill=True)
    out = chunked.generate([image_prompt(*images, text=text)], GREEDY, use_tqdm=False)[0]
    chunked.close()
    assert len(out.prompt_token_ids) > 7
    assert out.outputs[0].token_ids == transformers_tokens(folder, text, images, 8)


def test_the_same_image_twice_is_encoded_once(llm):
    encoder_before = llm.core.runner.image_encoder
    before = encoder_before.encodes if encoder_before is not None else 0
    image = png(11)
    first = llm.generate([image_prompt(image)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    second = llm.generate([image_prompt(image)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.core.runner.image_encoder.encodes == before + 1
    assert first == second


def test_different_images_share_no_blocks_of_their_image_tokens(llm):
    a, b = png(21), png(22)
    llm.generate([image_prompt(a)], GREEDY, use_tqdm=False)
    out_b = llm.generate([image_prompt(b)], GREEDY, use_tqdm=False)[0]
    out_a = llm.generate([image_prompt(a)], GREEDY, use_tqdm=False)[0]
    # the prompts' token ids are the same (the placeholders do not depend on the pixels), the images' blocks not
    assert out_a.prompt_token_ids == out_b.prompt_token_ids
    assert out_a.metrics.num_cached_tokens > out_b.metrics.num_cached_tokens
    first_image_row = out_b.prompt_token_ids.index(QWEN_IMAGE)
    assert out_b.metrics.num_cached_tokens <= first_image_row  # only the text before the image came from a's blocks


@pytest.mark.parametrize(
    "raw, message",
    [(b"not an image", "not an image file"), (png(1)[:40], "not an image file")],
)
def test_a_malformed_image_is_refused_by_name(llm, raw, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        llm.generate([image_prompt(raw)], GREEDY, use_tqdm=False)
    assert e.value.param == "multi_modal_data"
    assert llm.generate([image_prompt(png(5))], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # engine unaffected


def test_too_many_images_are_refused(llm):
    text = "<|vision_start|><|image_pad|><|vision_end|>" * 9
    with pytest.raises(InvalidRequestError, match="9 images; at most 8"):
        llm.generate([image_prompt(*[png(i) for i in range(9)], text=text)], GREEDY, use_tqdm=False)


def test_an_image_for_a_text_only_model_is_refused(tmp_path):
    llm = LLM(str(save_tiny_model("qwen2", tmp_path / "m")), dtype="float32")
    with pytest.raises(InvalidRequestError, match="takes no image input"):
        llm.generate([image_prompt(png(1), text="<|image_pad|>")], GREEDY, use_tqdm=False)
    llm.close()


def test_an_image_for_gemma3_is_refused_by_name_and_its_text_runs(tmp_path):
    llm = LLM(str(save_tiny_vision_model("gemma3-vl", tmp_path / "g")), dtype="float32")
    with pytest.raises(InvalidRequestError, match="implemented for Qwen2.5-VL, not gemma3"):
        llm.generate([image_prompt(png(1), text="<|image_pad|>")], GREEDY, use_tqdm=False)
    assert len(llm.generate(["to be"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    llm.close()


def test_text_and_image_prompts_in_one_batch_answer_as_alone(folder, llm):
    """A step mixing a text prompt (its three M-RoPE streams equal) with an image prompt, either order; each image
    new to the prefix cache, so its prefill runs in the mixed step."""
    text = [17, 400, 23, 99, 5, 61]
    alone_text = llm.generate([text], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for k, image_first in enumerate([False, True]):
        image = png(32 + k)
        batch = [image_prompt(image), text] if image_first else [text, image_prompt(image)]
        outs = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        image_out, text_out = outs if image_first else outs[::-1]
        assert text_out == alone_text
        assert image_out == transformers_tokens(folder, PROMPT, [image], 8)
