"""Image input for a vision-language checkpoint (Qwen2.5-VL): the frontend's part, the processor's output as a
message (ImageInput: pixel rows, each image's grid and content hash, the prompt with its image tokens expanded); the
engine core's part, the ImageEncoder, which runs transformers' own vision tower on the model's device (each image
once: a small LRU by content hash), and lays a request's image embeddings and M-RoPE positions out for its prompt
(MultiModalInput, on the Request). The runner puts the embedding rows of a step's image tokens in place of the
token embeddings (engine/step_inputs.py), and the KV cache's block hashes name the images their blocks hold."""

from __future__ import annotations

import hashlib
import io
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import torch
from safetensors import safe_open

from fulcrum.errors import InvalidRequestError, ModelLoadError

IMAGE_MODEL_TYPES = ("qwen2_5_vl",)  # the vision-language models whose image input fulcrum implements
IMAGE_CACHE_SIZE = 64  # image embeddings kept by content hash
MAX_IMAGES = 8  # per request


class ImageInput(msgspec.Struct, array_like=True):
    """One request's images as the model's processor prepared them (what crosses to the engine core)."""

    pixel_values: bytes  # float32 [sum of the images' patch counts, patch_dim], the images' rows one after another
    patch_dim: int
    grid_thw: list[list[int]]  # per image: the patch grid (time, height, width)
    hashes: list[str]  # per image: the sha256 of its file's bytes


def image_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class MultiModalInput:
    """A request's images laid out on its prompt: `embeds[i]` replaces the embedding of prompt token
    `token_rows[i]`; `spans` (first prompt index of an image's tokens, its hash) seed the KV block hashes;
    `mrope_positions` [3, prompt length] are the prompt's M-RoPE positions, `mrope_delta` what a generated token's
    position adds to its index (all three streams)."""

    embeds: torch.Tensor
    token_rows: list[int]
    spans: list[tuple[int, str]]
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0

    def rows_in(self, start: int, end: int) -> tuple[list[int], torch.Tensor]:
        """The image rows of prompt positions [start, end) (a prefill chunk): their offsets from start, embeddings."""
        idx = [i for i, p in enumerate(self.token_rows) if start <= p < end]
        return [self.token_rows[i] - start for i in idx], self.embeds[idx]

    def positions(self, start: int, end: int) -> list[list[int]]:
        """M-RoPE positions [3][end - start] of token positions [start, end): the prompt's, then generated tokens'."""
        n = self.mrope_positions.shape[1]
        out = self.mrope_positions[:, start : min(end, n)].tolist()
        later = [p + self.mrope_delta for p in range(max(start, n), end)]
        return [row + later for row in out]


def mrope_positions(
    prompt: list[int], image_token: int, grids: list[list[int]], merge: int
) -> tuple[torch.Tensor, int]:
    """Qwen2-VL's M-RoPE positions (transformers' get_rope_index for images): a text token's three streams are its
    running position; an image's merged t x h x w tokens take (start + t, start + row, start + column), and the text
    after it starts past the largest of those."""
    streams: list[list[int]] = [[], [], []]
    cur, i, image = 0, 0, 0
    while i < len(prompt):
        if prompt[i] != image_token:
            for s in streams:
                s.append(cur)
            cur, i = cur + 1, i + 1
            continue
        t, h, w = grids[image][0], grids[image][1] // merge, grids[image][2] // merge
        for ti in range(t):
            for hi in range(h):
                for wi in range(w):
                    streams[0].append(cur + ti)
                    streams[1].append(cur + hi)
                    streams[2].append(cur + wi)
        cur += max(t, h, w)
        i += t * h * w
        image += 1
    positions = torch.tensor(streams, dtype=torch.long)
    return positions, cur - len(prompt)


class ImageEncoder:
    """Transformers' vision tower of a Qwen2.5-VL checkpoint on the model's device, with its weights from the
    checkpoint (under `visual.` or `model.visual.`)."""

    def __init__(self, mm_config, path, device, dtype: torch.dtype):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        if mm_config.model_type not in IMAGE_MODEL_TYPES:
            raise ModelLoadError(f"image input is implemented for Qwen2.5-VL only, not {mm_config.model_type}")
        self.image_token = mm_config.image_token_id
        self.merge = mm_config.vision_config.spatial_merge_size
        with torch.device(device):
            self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(mm_config.vision_config, dtype=dtype)
        state = {}
        from fulcrum.models.loader import safetensors_files

        for file in safetensors_files(path):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    for prefix in ("model.visual.", "visual."):
                        if name.startswith(prefix):
                            state[name.removeprefix(prefix)] = f.get_tensor(name)
        missing, unexpected = self.visual.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ModelLoadError(f"vision tower tensors: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.visual.eval()
        self.device, self.dtype = device, dtype
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encodes = 0  # images run through the tower (a repeated image is served from the cache)

    @torch.no_grad()
    def _encode(self, pixels: torch.Tensor, grid: list[int]) -> torch.Tensor:
        self.encodes += 1
        out = self.visual(pixels.to(self.device, self.dtype), grid_thw=torch.tensor([grid], device=self.device))
        return out.pooler_output

    def prepare(self, prompt: list[int], images: ImageInput) -> MultiModalInput:
        rows = torch.frombuffer(bytearray(images.pixel_values), dtype=torch.float32).view(-1, images.patch_dim)
        embeds, at = [], 0
        for grid, key in zip(images.grid_thw, images.hashes):
            n = grid[0] * grid[1] * grid[2]
            if key in self.cache:
                self.cache.move_to_end(key)
            else:
                self.cache[key] = self._encode(rows[at : at + n], grid)
                if len(self.cache) > IMAGE_CACHE_SIZE:
                    self.cache.popitem(last=False)
            embeds.append(self.cache[key])
            at += n
        token_rows = [i for i, t in enumerate(prompt) if t == self.image_token]
        embeds = torch.cat(embeds)
        if len(token_rows) != embeds.shape[0]:
            raise InvalidRequestError(
                f"the prompt has {len(token_rows)} image tokens where its images give {embeds.shape[0]}", "messages"
            )
        spans, at = [], 0
        for grid, key in zip(images.grid_thw, images.hashes):
            spans.append((token_rows[at], key))
            at += grid[0] * grid[1] * grid[2] // self.merge**2
        positions, delta = mrope_positions(prompt, self.image_token, images.grid_thw, self.merge)
        return MultiModalInput(embeds, token_rows, spans, positions, delta)


def image_input(image_processor, prompt: list[int], images: list, raw: list[bytes], mm_config, field: str):
    """(prompt token ids, ImageInput) for a prompt with one image token (`<|image_pad|>`, as Qwen's chat template
    writes it) per image: the image processor's pixel rows and grids, each image token repeated for its image's
    merged patch count, as Qwen2.5-VL's processor expands it (built here from its parts: transformers' processor
    class wants a video processor, which needs torchvision)."""
    pad = mm_config.image_token_id
    if prompt.count(pad) != len(images):
        raise InvalidRequestError(f"{field}: the prompt has {prompt.count(pad)} image placeholders for "
                                  f"{len(images)} images", field)  # fmt: skip
    out = image_processor(images=images, return_tensors="pt")
    grids = out["image_grid_thw"].tolist()
    merge = mm_config.vision_config.spatial_merge_size
    counts = iter(t * h * w // merge**2 for t, h, w in grids)
    ids = [x for token in prompt for x in ([pad] * next(counts) if token == pad else [token])]
    pixels = out["pixel_values"].float().contiguous()
    return ids, ImageInput(pixels.numpy().tobytes(), pixels.shape[1], grids, [image_hash(b) for b in raw])


def open_images(raw: list[bytes], fields: list[str]) -> list:
    """PIL images from image files' bytes; one that is not an image is an InvalidRequestError naming its field."""
    from PIL import Image, UnidentifiedImageError

    images = []
    for i, data in enumerate(raw):
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, ValueError) as e:
            field = fields[i]
            raise InvalidRequestError(f"{field}: image {i} is not an image file PIL can read ({e})", field) from None
        images.append(image.convert("RGB"))
    return images


class ImagePrompts:
    """The frontend's side: the model folder's image processor and tokenizer turn a prompt with images into the
    prompt's token ids, image tokens expanded, and the ImageInput the engine core encodes."""

    def __init__(self, model_config, tokenizer):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.image_processor = None

    @property
    def placeholder(self) -> str:
        """What stands for one image in a prompt's text."""
        mm = self.model_config.multimodal_config
        if mm.model_type not in IMAGE_MODEL_TYPES:
            return ""
        ids = [mm.vision_start_token_id, mm.image_token_id, mm.vision_end_token_id]
        return "".join(self.tokenizer.convert_ids_to_tokens(ids))

    def __call__(
        self, prompt: list[int], raw: list[bytes], field: str, image_fields: list[str] | None = None
    ) -> tuple[list[int], ImageInput]:
        """`prompt`: token ids with one image token per image (the placeholder's); `field` names the request's
        images in errors, `image_fields` each image (default: field)."""
        mm = self.model_config.multimodal_config
        if mm is None:
            raise InvalidRequestError(f"{field}: model {self.model_config.path.name} takes no image input", field)
        if mm.model_type not in IMAGE_MODEL_TYPES:  # Gemma 3: its text path runs, its image path is not built yet
            raise InvalidRequestError(f"{field}: image input is implemented for Qwen2.5-VL, not {mm.model_type}",
                                      field)  # fmt: skip
        if len(raw) > MAX_IMAGES:
            raise InvalidRequestError(f"{field}: {len(raw)} images; at most {MAX_IMAGES} per request", field)
        if self.image_processor is None:
            from transformers import AutoImageProcessor

            self.image_processor = AutoImageProcessor.from_pretrained(self.model_config.path, local_files_only=True)
        images = open_images(raw, image_fields or [field] * len(raw))
        return image_input(self.image_processor, prompt, images, raw, mm, field)
