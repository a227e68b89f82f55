"""`...ForConditionalGeneration` checkpoints (a vision tower and a language model in one folder): fulcrum's text
model of the family, built from the nested `text_config` (fulcrum.model_folder.hf_config.language_model_config),
loading the language model's tensors under the names each release writes and passing over the vision tower's
(which transformers' own module runs: fulcrum.engine.multimodal)."""

from __future__ import annotations

import torch

from fulcrum.config import rope_parameters
from fulcrum.models.gemma import Gemma3ForCausalLM
from fulcrum.models.llama import LlamaModel, Qwen2ForCausalLM

# checkpoint prefix -> fulcrum's: transformers 5 saves the older layout (`language_model.model.` for Gemma 3, the
# text model at `model.` for Qwen2.5-VL) and reads the newer one (`model.language_model.`); either loads
LANGUAGE_MODEL_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
VISION_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "visual.",
    "model.vision_tower.", "model.multi_modal_projector.", "model.visual.",
)  # fmt: skip


class VisionLanguageCheckpoint:
    """Maps a vision-language checkpoint's tensor names onto the text model's (None: a vision tensor)."""

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        if name.startswith(VISION_PREFIXES):
            return None
        for prefix, ours in LANGUAGE_MODEL_PREFIXES.items():
            if name.startswith(prefix):
                return ours + name.removeprefix(prefix)
        return name


class Gemma3ForConditionalGeneration(VisionLanguageCheckpoint, Gemma3ForCausalLM):
    pass


class MRopeModel(LlamaModel):
    """Qwen2's stack with M-RoPE: the rotary angles of each frequency band (rope_parameters' mrope_section) follow
    one of three position streams (time, height, width). Positions [T] (text: the three streams equal) are the
    ordinary rope; positions [3, T] (a step with image tokens: engine/multimodal.py) pick each band's stream."""

    def __init__(self, cfg, family, dtype, quant):
        super().__init__(cfg, family, dtype, quant)
        section = rope_parameters(cfg).get("mrope_section") or [16, 24, 24]
        stream = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
        self.register_buffer("mrope_stream", torch.cat((stream, stream)), persistent=False)  # [head_dim]

    def ropes(self, positions, dtype):
        if positions.dim() == 1:
            return self.rotary_emb(positions, dtype)
        table = self.rotary_emb
        index = self.mrope_stream.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = table.cos[positions].gather(0, index)[0]  # [T, head_dim]: column j from stream mrope_stream[j]
        sin = table.sin[positions].gather(0, index)[0]
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


class Qwen2_5_VLForConditionalGeneration(VisionLanguageCheckpoint, Qwen2ForCausalLM):  # noqa: N801 (HF's name)
    """Qwen2.5-VL's language model: Qwen2's with M-RoPE (MRopeModel)."""

    base_model_class = MRopeModel


# architectures refused by name, with the reason
REFUSED = {
    "Llama4ForConditionalGeneration": "fulcrum has no Llama 4 text model (its MoE with a shared expert, chunked "
    "local attention interleaved with global NoPE layers) to load the language model into",
    "Llama4ForCausalLM": "fulcrum has no Llama 4 text model (its MoE with a shared expert, chunked local attention "
    "interleaved with global NoPE layers)",
}
