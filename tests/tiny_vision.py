"""Tiny random vision-language checkpoints (`...ForConditionalGeneration`), built from transformers' own config
and model classes with their real field names and saved with `save_pretrained`, as the releases are."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForImageTextToText,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
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


def _qwen2_5_vl(**text):
    return Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig(
        text_config=dict(COMMON, rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3]), **text),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=COMMON["hidden_size"],
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0],
        ),
        image_token_id=IMAGE_TOKEN, video_token_id=2003, vision_start_token_id=START_TOKEN,
        vision_end_token_id=END_TOKEN, tie_word_embeddings=False,
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
    return folder


def hf_vision_model(folder: Path):
    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
