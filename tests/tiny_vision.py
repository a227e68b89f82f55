"""Tiny random vision-language checkpoints (`...ForConditionalGeneration`), built from transformers' own config
and model classes with their real field names and saved with `save_pretrained`, as the releases are."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from PIL import Image
from transformers import (
    AutoModelForImageTextToText,
    AutoTokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessor,
)

from fulcrum.config import DEFAULT_MODEL
from fulcrum.utils.tokenizer import copy_tokenizer
from tests.tiny_models import COMMON

# image-token ids past the tiny text vocabulary's ordinary tokens (the bundled tokenizer's 2048)
IMAGE_TOKEN, START_TOKEN, END_TOKEN = 2000, 2001, 2002


def _gemma3(**text):
    return Gemma3ForConditionalGeneration, Gemma3Config(
        text_config=dict(COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=16, **text),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=START_TOKEN,
        eoi_token_index=END_TOKEN, tie_word_embeddings=True,
    )  # fmt: skip


# Qwen2.5-VL's special tokens, added to the bundled tokenizer (ids 2048 ..) as Qwen's tokenizer has them
QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_START, QWEN_END, QWEN_IMAGE, QWEN_VIDEO = 2048, 2049, 2050, 2051


def _qwen2_5_vl(**text):
    return Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig(
        text_config=dict(COMMON, vocab_size=2056, rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3]), **text),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=COMMON["hidden_size"],
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0],
        ),
        image_token_id=QWEN_IMAGE, video_token_id=QWEN_VIDEO, vision_start_token_id=QWEN_START,
        vision_end_token_id=QWEN_END, tie_word_embeddings=False,
    )  # fmt: skip


VISION_FAMILIES = {"gemma3-vl": _gemma3, "qwen2_5-vl": _qwen2_5_vl}


def save_tiny_vision_model(family: str, folder: Path, seed: int = 0, **text) -> Path:
    torch.manual_seed(seed)
    cls, cfg = VISION_FAMILIES[family](**text)
    cfg.text_config.initializer_range = 0.1
    model = cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                # Gemma's (1 + w) starts at w = 0, Qwen's w at 1: spread them so a missed norm shows
                p.normal_(0.0, 0.2) if family.startswith("gemma") else p.uniform_(0.6, 1.4)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    copy_tokenizer(DEFAULT_MODEL, folder)
    if family == "qwen2_5-vl":
        save_qwen_processor(folder)
    return folder


def save_qwen_processor(folder: Path) -> None:
    """Qwen2.5-VL's two processor parts: the tokenizer with its vision tokens, and Qwen2-VL's image processor at a
    tiny size (56 x 56 to 112 x 112 pixels: 4 to 16 image tokens). Not the Qwen2_5_VLProcessor class itself:
    transformers 5.25 wants a video processor with it, which needs torchvision (not installed)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VISION_TOKENS})
    assert tokenizer.convert_tokens_to_ids(QWEN_VISION_TOKENS) == [QWEN_START, QWEN_END, QWEN_IMAGE, QWEN_VIDEO]
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessor(
        size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, patch_size=14, temporal_patch_size=2, merge_size=2
    ).save_pretrained(folder)


def png(seed: int, size: tuple[int, int] = (60, 80)) -> bytes:
    """A random RGB image as a PNG file's bytes."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (*size, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def hf_vision_model(folder: Path):
    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
