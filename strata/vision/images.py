"""Images in a prompt, for the front ends: a model's vision tower, where its images go in
the token sequence, and what keys them in the conversation cache.

A prompt names an image where the release's chat template puts one,
`<|vision_start|><|image_pad|><|vision_end|>` (MARKER): chat messages carry images as
content parts, which `flatten` turns into that text; `expand` then gives each image's one
`<|image_pad|>` the image's token count, as transformers' Qwen3VLProcessor does. The tower
(strata.models.vision) turns an image's pixels into those tokens' rows, and
`Qwen4Exp.add_images` puts them and their M-RoPE positions in the sequence.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from strata.models.vision import VisionError, VisionTower
from strata.names.qwen4exp import mmproj_sidecar
from strata.vision.preprocess import ImageConfig, ImageError, Pixels, decode_data_url, preprocess

MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"


def find_mmproj(model_path: str | os.PathLike, given: str | os.PathLike | None = None) -> Path | None:
    """`--mmproj PATH`, else `mmproj-<name>` beside the model's file where there is one."""
    if given is not None:
        path = Path(given).expanduser()
        if not path.is_file():
            raise VisionError(f"--mmproj {given}: no such file")
        return path
    side = mmproj_sidecar(model_path)
    return side if side.is_file() else None


@dataclass
class Image:
    """One image of a prompt, read and resized (the tower runs later, on the engine's thread)."""
    pixels: Pixels
    label: str

    @property
    def grid(self) -> tuple[int, int]:
        """(h', w'): the image's merged patches, one text token each, row-major."""
        _, h, w = self.pixels.grid_thw
        m = self.pixels.merge_size
        return h // m, w // m

    @property
    def n_tokens(self) -> int:
        return self.pixels.n_tokens


class Vision:
    """A model's eyes: its tower (mmproj file), the image settings and the vision tokens of
    its vocabulary."""

    def __init__(self, tower: VisionTower, model, tokenizer, path: Path):
        self.tower, self.model, self.path = tower, model, path
        cfg = tower.cfg
        self.image_cfg = ImageConfig(patch_size=cfg.patch, merge_size=cfg.merge, temporal_patch_size=cfg.temporal,
                                     image_mean=cfg.image_mean, image_std=cfg.image_std)
        # the file's id (written beside the PLE block), else the vocabulary's token of that name
        pad = model.cfg.image_token
        if pad is None:
            ids = tokenizer.encode(IMAGE_PAD, add_bos=False)
            pad = ids[0] if len(ids) == 1 else None
        if pad is None or tokenizer.token_to_piece(pad) != IMAGE_PAD:
            raise VisionError(f"{model.gguf.path}: its vocabulary has no {IMAGE_PAD}"
                              f"{f' at the file image token id {pad}' if pad is not None else ''}; give a model "
                              f"converted with its vision tower")
        self.pad = pad
        if model.cfg.dim != cfg.out_dim:
            raise VisionError(f"{path}: the tower gives rows of {cfg.out_dim}, the model {model.gguf.path} "
                              f"takes {model.cfg.dim}: the two files are not of one checkpoint")

    @classmethod
    def load(cls, model, tokenizer, path: str | os.PathLike) -> Vision:
        if not hasattr(model, "add_images"):
            raise VisionError(f"{model.gguf.path} ({model.gguf.arch}) takes no images; images need a "
                              f"qwen4exp model")
        if getattr(model, "pipe", None) is not None:
            raise VisionError("images with --pp: only the first stage would see them; run images without --pp")
        return cls(VisionTower.load(path, model.device), model, tokenizer, Path(path))

    def describe(self) -> str:
        c = self.tower.cfg
        return (f"vision: {self.path.name} (Qwen3-VL tower, {c.depth} blocks of {c.dim}, patches of {c.patch} "
                f"merged {c.merge}x{c.merge}; an image takes {self.image_cfg.min_pixels // (c.patch * c.merge) ** 2}"
                f" to {self.image_cfg.max_pixels // (c.patch * c.merge) ** 2} tokens)")

    def read(self, source, label: str | None = None, local: bool = True) -> Image:
        """An image from a path, bytes or a `data:` URL (`label` names it in errors; a path
        names itself). Without `local`, a string must be a `data:` URL (the server's case:
        a client must not have it read the server's own files)."""
        if isinstance(source, str) and (source.startswith("data:") or "://" in source or not local):
            source = decode_data_url(source, label)  # refuses any other URL, saying why
        return Image(preprocess(source, self.image_cfg, label), label or str(source))

    def encode(self, image: Image) -> torch.Tensor:
        """The image's rows for the text model, (n_tokens, dim)."""
        return self.tower(image.pixels.values, image.pixels.grid_thw)

    def expand(self, ids: list[int], images: list[Image]) -> list[int]:
        """`ids` with each image's one placeholder token repeated to its token count."""
        at = [i for i, t in enumerate(ids) if t == self.pad]
        if len(at) != len(images):
            raise ImageError(f"the prompt names {len(at)} image(s) ({IMAGE_PAD}) for {len(images)} given: "
                             f"each image needs its place, {MARKER}")
        out, last = [], 0
        for i, image in zip(at, images):
            out += ids[last:i] + [self.pad] * image.n_tokens
            last = i + 1
        return out + ids[last:]

    def key(self, ids: list[int], images: list[Image]) -> list[int]:
        """`ids` with each image's tokens replaced by numbers drawn from its pixels: the
        conversation cache reuses a prefix only where its images are the same."""
        out, it, run = list(ids), iter(images), False
        for i, t in enumerate(ids):
            if t == self.pad:
                if not run:
                    tag = -1 - int(next(it).pixels.digest[:15], 16)  # a sha256: any 60 bits of it
                out[i], run = tag, True
            else:
                run = False
        return out

    def prepare(self, state, ids: list[int], images: list[Image]) -> None:
        """Put `images` in `state` for the sequence `ids` (from its first token: what the
        state holds, a conversation cache's prefix, and the rest); images whose tokens the
        state holds already are not run through the tower again."""
        ends, start = [], 0
        for image in images:
            start = ids.index(self.pad, start) + image.n_tokens
            ends.append(start)
        self.model.add_images(state, ids, [(self.encode(im) if end > state.length else None, im.grid)
                                           for im, end in zip(images, ends)], self.pad)


class PartError(ValueError):
    """A message content part of no kind Strata takes; the message names the part."""


def flatten(messages: list[dict[str, Any]], where: str = "messages",
            local: bool = False) -> tuple[list[dict[str, Any]], list[tuple[Any, str]]]:
    """Chat messages whose content may be a list of parts (OpenAI's: {"type": "text", "text"},
    {"type": "image_url", "image_url": {"url"}}; and with `local`, {"type": "image", "image":
    a path or bytes}) -> the same messages with text content, each image part as MARKER,
    and the images' sources in order with a label naming each part. The server leaves
    `local` off: a client must not have it read the server's own files."""
    out, sources = [], []
    for i, m in enumerate(messages):
        content = m.get("content", "")
        if not isinstance(content, list):
            out.append(m)
            continue
        text = []
        for j, part in enumerate(content):
            label = f"{where}[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                text.append(part["text"])
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise PartError(f"{label}: an image_url part needs image_url.url, a data: URL")
                sources.append((url, label))
                text.append(MARKER)
            elif local and kind == "image" and isinstance(part.get("image"), (str, os.PathLike, bytes, bytearray)):
                sources.append((part["image"], label))
                text.append(MARKER)
            else:
                raise PartError(f"{label}: a content part must be {{'type': 'text', 'text': ...}} or "
                                 f"{{'type': 'image_url', 'image_url': {{'url': 'data:image/...'}}}}, got "
                                 f"{str(part)[:80]}")
        out.append({**m, "content": "".join(text)})
    return out, sources
