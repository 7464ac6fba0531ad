"""Image preprocessing for the vision tower of qwen4exp models: from an image file, its bytes,
or a PIL image to the flat patch rows (`pixel_values`) and the patch grid (`image_grid_thw`)
the tower takes, plus the number of image placeholder tokens the text model gets.

transformers maps the model type `qwen4_exp` to Qwen2-VL's image processor (without
torchvision, `Qwen2VLImageProcessorPil`, models/qwen2_vl/image_processing_pil_qwen2_vl.py),
so this file follows that processor step for step, with Pillow and numpy and no transformers
import: the same RGB conversion, `smart_resize` to a multiple of patch_size * merge_size,
the same Pillow resample filter, rescale by 1/255 (in float64, then float32), normalize,
and the same patch layout. A file or bytes are first loaded as transformers' `load_image`
loads a path or a data URL; a PIL image given directly is taken as the processor takes one.

Bad input (a missing, empty, truncated or non-image file, an image too large to decode, an
aspect ratio the resize refuses, a data URL that is not an inline image) raises `ImageError`,
whose message names the source and says what to do.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import re
import stat
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Union

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

# Refused before decoding. 8192 x 8192 is four times the release's max_pixels (4096 x 4096),
# so any image worth downscaling still goes through, and it sits below Pillow's own
# decompression-bomb bound (Image.MAX_IMAGE_PIXELS, about 89.5 million), which is why a
# bomb is normally caught by this check first.
MAX_SOURCE_PIXELS = 8192 * 8192

# smart_resize raises beyond this long-to-short edge ratio.
MAX_ASPECT_RATIO = 200

ImageSource = Union[bytes, bytearray, memoryview, str, os.PathLike, Image.Image]


class ImageError(ValueError):
    """An image Strata cannot take; the message names the source (a path or the caller's
    label), says what is wrong and what to do."""


# Qwen2VLImageProcessorPil's class attributes: what a key that a preprocessor_config.json
# leaves out falls back to in transformers. Not the release's values.
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
    "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280,
    "image_mean": _OPENAI_CLIP_MEAN, "image_std": _OPENAI_CLIP_STD,
    "resample": int(Image.Resampling.BICUBIC), "rescale_factor": 1 / 255,
}


@dataclass(frozen=True)
class ImageConfig:
    """The image processor settings. The defaults are the preprocessor_config.json that the
    Qwen3-VL and Qwen3.5 releases ship (the settings qwen4exp's vision tower was built
    for): patch 16, merge 2, temporal patch 2, mean and std 0.5, size {"shortest_edge":
    65536 (256 x 256), "longest_edge": 16777216 (4096 x 4096)}; resample 3 (bicubic) and
    rescale 1/255 are the processor's class defaults, which those files keep."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    resample: int = int(Image.Resampling.BICUBIC)
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ImageConfig.{name} must be a positive integer, got {value!r}")
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"ImageConfig: max_pixels {self.max_pixels} is below min_pixels {self.min_pixels}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            # the processor takes a single number for all three channels too
            triple = (value,) * 3 if isinstance(value, (int, float)) else tuple(value)
            if len(triple) != 3:
                raise ValueError(f"ImageConfig.{name} needs 3 values (R, G, B), got {value!r}")
            # stored as a tuple of floats so the config hashes and can key a cache
            object.__setattr__(self, name, tuple(float(v) for v in triple))
        if 0.0 in self.image_std:
            raise ValueError(f"ImageConfig.image_std has a zero: {self.image_std}")
        try:
            object.__setattr__(self, "resample", int(Image.Resampling(self.resample)))
        except ValueError:
            raise ValueError(f"ImageConfig.resample {self.resample!r} is not a Pillow resampling filter "
                             f"({', '.join(f'{f.value} {f.name}' for f in Image.Resampling)})") from None

    @property
    def factor(self) -> int:
        """Both resized edges are a multiple of this: one merged token's edge in pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> ImageConfig:
        """The settings a HF preprocessor_config.json dict gives Qwen2VLImageProcessorPil.

        Read as transformers reads them: the pixel bounds from `size` {"shortest_edge",
        "longest_edge"}, where top-level `min_pixels` / `max_pixels` (older Qwen2-VL files)
        win; a key left out takes the processor's class default (patch 14, CLIP mean and
        std, 56*56 to 28*28*1280 pixels), not the release's. A null is taken as left out
        (transformers would keep the None and fail later). A processor_config.json dict
        with the settings under "image_processor" is read from there.
        """
        if isinstance(config.get("image_processor"), Mapping):
            config = config["image_processor"]
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(flag) is False:
                raise ValueError(f"preprocessor config sets {flag}=false; the vision tower is fed "
                                 f"resized, rescaled, normalized RGB images only")

        def pick(key: str) -> Any:
            value = config.get(key)
            return _PROCESSOR_DEFAULTS[key] if value is None else value

        size = config.get("size")
        if size is None:
            size = {"shortest_edge": _PROCESSOR_DEFAULTS["min_pixels"],
                    "longest_edge": _PROCESSOR_DEFAULTS["max_pixels"]}
        elif not isinstance(size, Mapping):
            raise ValueError(f"preprocessor config: size must be a dict with 'shortest_edge' and "
                             f"'longest_edge' (the pixel bounds), got {size!r}")
        min_pixels = config.get("min_pixels")
        max_pixels = config.get("max_pixels")
        min_pixels = size.get("shortest_edge") if min_pixels is None else min_pixels
        max_pixels = size.get("longest_edge") if max_pixels is None else max_pixels
        if not min_pixels or not max_pixels:
            raise ValueError(f"preprocessor config: size needs both 'shortest_edge' (min pixels) and "
                             f"'longest_edge' (max pixels), got size={dict(size)!r}")
        return cls(patch_size=pick("patch_size"), merge_size=pick("merge_size"),
                   temporal_patch_size=pick("temporal_patch_size"),
                   min_pixels=min_pixels, max_pixels=max_pixels,
                   image_mean=pick("image_mean"), image_std=pick("image_std"),
                   resample=pick("resample"), rescale_factor=pick("rescale_factor"))


@dataclass(frozen=True, eq=False)
class Pixels:
    """One preprocessed image: `values` (grid_t*grid_h*grid_w, 3*temporal_patch*patch*patch)
    float32, one row per patch, merge_size x merge_size neighbours consecutive; `grid_thw`
    (t, h, w) in patches; `digest` the sha256 of the decoded RGB pixels and their size, so a
    cache can key an image by its content whatever file format carried it."""

    values: torch.Tensor
    grid_thw: tuple[int, int, int]
    digest: str
    merge_size: int

    @property
    def n_tokens(self) -> int:
        """The image placeholder tokens the text model gets: one per merged patch group."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size ** 2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' `smart_resize`: the (height, width) nearest the image's aspect ratio with
    both edges multiples of `factor` and the area within [min_pixels, max_pixels]. Python's
    round (half to even) and float math on purpose: a different rounding moves some edges
    by a whole factor. Raises ValueError past MAX_ASPECT_RATIO."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                         f"got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(image: ImageSource, cfg: ImageConfig, label: str | None = None) -> Pixels:
    """Decode `image` (bytes, a file path, or a PIL image) and lay it out for the vision tower.

    `label` names the image in error messages (e.g. "messages[0].content[1]"); a path is
    named as well. Raises ImageError for input that is not a usable image.
    """
    rgb, source = _decode(image, label, cfg.max_pixels)
    width, height = rgb.size
    if width == 0 or height == 0:
        raise ImageError(f"{source}: the image is {width}x{height} and has no pixels; send a non-empty image")
    try:
        new_h, new_w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except ValueError:
        ratio = max(width, height) / min(width, height)
        raise ImageError(f"{source}: the image is {width}x{height}, an aspect ratio of {ratio:.0f}:1, "
                         f"more than the {MAX_ASPECT_RATIO}:1 the vision tower takes; crop it or pad "
                         f"the short edge") from None
    digest = hashlib.sha256(b"RGB %dx%d\n" % (width, height) + rgb.tobytes()).hexdigest()

    # reducing_gap stays None, as transformers leaves it: Pillow's two-step reduction
    # changes the pixels
    resized = np.asarray(rgb.resize((new_w, new_h), resample=cfg.resample))
    # float64 first, then float32: transformers' rescale does so, and a float32 product
    # differs in the last bit for some values
    x = (resized.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = (x - np.asarray(cfg.image_mean, dtype=np.float32)) / np.asarray(cfg.image_std, dtype=np.float32)

    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    grid_h, grid_w = new_h // p, new_w // p
    # (H, W, C) -> (gh/m, gw/m, m, m, C, p, p): merge groups in raster order, each group's
    # m x m patches in raster order, a patch's pixels channel-major
    x = x.reshape(grid_h // m, m, p, grid_w // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    # a still image fills every frame of a temporal patch
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    rows = np.ascontiguousarray(x.reshape(grid_h * grid_w, 3 * t * p * p))
    return Pixels(values=torch.from_numpy(rows), grid_thw=(1, grid_h, grid_w), digest=digest, merge_size=m)


def decode_data_url(url: str, label: str | None = None) -> bytes:
    """The image bytes of an OpenAI `image_url` value, which must be an inline
    `data:image/<type>;base64,<data>` URL: images are never fetched from elsewhere.
    `label` names the value in error messages (default "image_url")."""
    where = label or "image_url"
    if not isinstance(url, str):
        raise ImageError(f"{where}: expected a data:image/...;base64,... URL string, got {type(url).__name__}")
    text = url.strip()
    found = _DATA_URL.match(text)
    if found is None:
        scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", text)
        what = f"a URL of scheme {scheme.group(1).lower()}:" if scheme else "not a URL"
        raise ImageError(f"{where}: {_preview(text)} is {what}; only data: URLs are taken "
                         f"(data:image/png;base64,...) and no remote or file URL is fetched, "
                         f"so send the image inline, base64-encoded")
    mime = found["mime"].strip().lower()
    if not mime.startswith("image/"):
        raise ImageError(f"{where}: the data: URL holds {mime or 'no media type'!s}, not an image; "
                         f"send data:image/<type>;base64,<the image file in base64>")
    if "base64" not in (p.strip().lower() for p in found["params"].split(";")):
        raise ImageError(f"{where}: the data: URL is not base64-encoded (no ';base64'); "
                         f"send data:{mime};base64,<the image file in base64>")
    # clients wrap long base64 at 76 columns; the line breaks carry nothing
    payload = re.sub(r"\s+", "", found["payload"])
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{where}: the data: URL's base64 does not decode ({e}); "
                         f"send the image file in standard base64 (A-Z a-z 0-9 + /, '=' padded)") from None
    if not data:
        raise ImageError(f"{where}: the data: URL holds no bytes; send the image file in base64")
    return data


_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<payload>.*)\Z", re.IGNORECASE | re.DOTALL)


def _preview(text: str, limit: int = 48) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def decode(image: ImageSource, label: str | None = None) -> Image.Image:
    """`image` decoded to RGB and refused as `preprocess` decodes and refuses it, with no
    ImageConfig: `strata generate` checks its --image files before it loads the model."""
    return _decode(image, label, None)[0]


def _decode(image: ImageSource, label: str | None, max_pixels: int | None) -> tuple[Image.Image, str]:
    """The decoded RGB image and the name its errors go by."""
    if isinstance(image, Image.Image):
        source = label or "image"
        _check_size(image.size, source, max_pixels)
        # a PIL image the caller opened may still be lazy: a damaged file fails here
        return _guarded(lambda: _to_rgb(image), source), source
    if isinstance(image, (bytes, bytearray, memoryview)):
        source = label or "image bytes"
        data = bytes(image)
        if not data:
            raise ImageError(f"{source}: no bytes (an empty image); send the image file's contents")
        fp: Any = io.BytesIO(data)
    elif isinstance(image, (str, os.PathLike)):
        path = os.fsdecode(image)
        source = f"{label} ({path})" if label else path
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ImageError(f"{source}: no such file; give the path of an existing image file") from None
        except OSError as e:
            raise ImageError(f"{source}: cannot be read ({e.strerror}); check the path and its permissions") from None
        if stat.S_ISDIR(st.st_mode):
            raise ImageError(f"{source}: is a directory, not an image file; give the path of an image file")
        if st.st_size == 0:
            raise ImageError(f"{source}: the file is empty (0 bytes); give a complete image file")
        fp = path
    else:
        raise TypeError(f"{label or 'image'}: expected image bytes, a file path or a PIL image, "
                        f"got {type(image).__name__}")

    def load() -> Image.Image:
        with Image.open(fp) as opened:
            # the header gives the size: refuse before the pixels are decoded
            _check_size(opened.size, source, max_pixels)
            # transformers' load_image, for a path or a data URL: EXIF orientation applied,
            # then convert("RGB"), which drops an alpha channel without compositing ...
            upright = ImageOps.exif_transpose(opened).convert("RGB")
        # ... then the processor's own conversion, which still composites a palette
        # image's transparent colour (kept in info["transparency"]) onto white
        return _to_rgb(upright)

    return _guarded(load, source), source


def _guarded(decode, source: str) -> Image.Image:
    """Runs a Pillow decode, turning its failures into ImageError."""
    try:
        with warnings.catch_warnings():
            # Pillow only warns between MAX_IMAGE_PIXELS and twice that; either is a refusal here
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return decode()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"{source}: refused as a decompression bomb ({e}); scale the image down "
                         f"below {MAX_SOURCE_PIXELS:,} pixels") from None
    except UnidentifiedImageError:
        raise ImageError(f"{source}: not an image file Pillow can read (PNG, JPEG, WebP, GIF, BMP, TIFF, ...); "
                         f"send the image as PNG or JPEG") from None
    except MemoryError:
        raise
    except Exception as e:
        # Pillow's plugins raise OSError, SyntaxError, ValueError, EOFError, struct.error, ...
        # for truncated or damaged data; all of them mean the same to the caller
        raise ImageError(f"{source}: the image data is truncated or damaged ({type(e).__name__}: {e}); "
                         f"send the complete, undamaged file") from None


def _check_size(size: tuple[int, int], source: str, max_pixels: int | None) -> None:
    width, height = size
    if width * height > MAX_SOURCE_PIXELS:
        tower = "" if max_pixels is None else \
            f" (the vision tower gets it resized to at most {max_pixels:,} pixels anyway)"
        raise ImageError(f"{source}: the image is {width}x{height} = {width * height:,} pixels, more than the "
                         f"{MAX_SOURCE_PIXELS:,} taken; scale it down{tower}")


def _to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: an image with an alpha band or a transparent colour is
    composited onto white, any other converted by Pillow (greyscale replicated, palette
    looked up, CMYK and YCbCr by Pillow's formulas)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
