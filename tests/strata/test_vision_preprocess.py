"""strata.vision.preprocess against transformers' Qwen2VLImageProcessorPil (the image processor
transformers runs for qwen4_exp), and its refusals of bad input."""
from __future__ import annotations

import base64
import functools
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from tests.tiers import examples
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from strata.vision.preprocess import (MAX_SOURCE_PIXELS, ImageConfig, ImageError, decode_data_url, preprocess,
                                      smart_resize)

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
# The Qwen3-VL / Qwen3.5 releases' preprocessor_config.json.
RELEASE = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
           "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
           "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
           "image_processor_type": "Qwen2VLImageProcessorFast"}
CONFIGS = [
    ImageConfig(),
    ImageConfig(min_pixels=4 * 32 * 32, max_pixels=64 * 32 * 32),  # small bounds: both resize branches
    ImageConfig(patch_size=14, merge_size=1, temporal_patch_size=3, min_pixels=14 * 14 * 4,
                max_pixels=14 * 14 * 100, image_mean=CLIP_MEAN, image_std=CLIP_STD, resample=2),
]


@functools.lru_cache(maxsize=None)
def hf(cfg: ImageConfig) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size, merge_size=cfg.merge_size, temporal_patch_size=cfg.temporal_patch_size,
        size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels},
        image_mean=list(cfg.image_mean), image_std=list(cfg.image_std), resample=cfg.resample)


def assert_equals_hf(got, ref):
    assert got.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert got.values.dtype == torch.float32 and got.values.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(got.values.numpy(), ref["pixel_values"], rtol=0, atol=1e-6)


@st.composite
def images(draw, max_edge=400):
    w = draw(st.integers(1, max_edge))
    h = draw(st.integers(-(-w // 200), min(max_edge, 200 * w)))  # within smart_resize's 200:1
    mode = draw(st.sampled_from(["RGB", "RGBA", "L", "P"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if mode == "P":
        im = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), "P")
        im.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tobytes())
        if draw(st.booleans()):
            im.info["transparency"] = int(rng.integers(0, 256))
        return im
    pixels = rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


# -- equal to transformers ------------------------------------------------------------------------

@settings(max_examples=examples(40), deadline=None)
@given(images(), st.sampled_from(CONFIGS))
def test_pil_image_equals_transformers(im, cfg):
    assert_equals_hf(preprocess(im, cfg), hf(cfg)(im, return_tensors="np"))


@settings(max_examples=examples(20), deadline=None)
@given(images(), st.sampled_from(CONFIGS))
def test_file_bytes_equal_transformers_given_the_data_url(im, cfg):
    # transformers loads a data URL or a path with load_image (EXIF transpose, convert("RGB"))
    url = data_url(png(im))
    assert_equals_hf(preprocess(decode_data_url(url), cfg), hf(cfg)(url, return_tensors="np"))


def test_large_image_equals_transformers():
    rng = np.random.default_rng(1)
    im = Image.fromarray(rng.integers(0, 256, (1531, 2049, 3), dtype=np.uint8))
    cfg = ImageConfig(max_pixels=1024 * 32 * 32)  # downscaled, as a photo is
    assert_equals_hf(preprocess(im, cfg), hf(cfg)(im, return_tensors="np"))


def test_path_applies_exif_orientation_as_transformers(tmp_path):
    im = Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 90, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 clockwise to view
    path = tmp_path / "photo.jpg"
    im.save(path, "JPEG", exif=exif)
    cfg = CONFIGS[1]
    got = preprocess(path, cfg)
    assert_equals_hf(got, hf(cfg)(str(path), return_tensors="np"))
    assert got.grid_thw[1] > got.grid_thw[2]  # stored 90 wide, 40 high: upright it is tall


def test_alpha_follows_transformers_per_input_kind():
    clear_red = Image.new("RGBA", (64, 64), (255, 0, 0, 0))
    # a PIL image given to the processor is composited onto white ...
    assert preprocess(clear_red, ImageConfig()).values.eq(1.0).all()
    # ... a file goes through load_image's convert("RGB") first, which drops alpha
    red = preprocess(png(clear_red), ImageConfig()).values.view(-1, 3, 2 * 16 * 16)
    assert red[:, 0].eq(1.0).all() and red[:, 1:].eq(-1.0).all()


@pytest.mark.parametrize("size, grid", [((640, 480), (1, 30, 40)), ((1, 1), (1, 16, 16)),
                                        ((300, 7), (1, 4, 106))])  # thin: scaled up to min_pixels
def test_grid_and_token_count(size, grid):
    w, h = size
    px = preprocess(Image.new("RGB", (w, h)), ImageConfig())
    assert px.grid_thw == grid and px.n_tokens == grid[1] * grid[2] // 4
    assert tuple(px.values.shape) == (grid[1] * grid[2], 3 * 2 * 16 * 16)


@given(st.integers(1, 5000), st.integers(1, 5000), st.sampled_from([28, 32]),
       st.integers(1, 2**16), st.integers(0, 2**24))
def test_smart_resize_equals_transformers(h, w, factor, min_pixels, extra):
    try:
        want = hf_smart_resize(h, w, factor, min_pixels, min_pixels + extra)
    except ValueError:
        with pytest.raises(ValueError):
            smart_resize(h, w, factor, min_pixels, min_pixels + extra)
    else:
        assert smart_resize(h, w, factor, min_pixels, min_pixels + extra) == want


def test_smart_resize_rounds_half_to_even():
    # 80 / 32 = 2.5 rounds to 2 (Python's round), 112 / 32 = 3.5 to 4
    assert smart_resize(80, 112, 32, 1, 10**8) == (64, 128)


# -- config ---------------------------------------------------------------------------------------

def test_defaults_are_the_release_config():
    assert ImageConfig.from_preprocessor_config(RELEASE) == ImageConfig()
    assert ImageConfig.from_preprocessor_config({"image_processor": RELEASE}) == ImageConfig()


@pytest.mark.parametrize("config", [
    {},
    RELEASE,
    {**RELEASE, "min_pixels": 3136, "max_pixels": 1000000},  # older files: these win over size
    {"size": {"shortest_edge": 1024, "longest_edge": 4096}, "resample": 2,
     "rescale_factor": 0.00392156862745098, "image_mean": [0.1, 0.2, 0.3]},
])
def test_config_reads_as_transformers_does(config):
    cfg, proc = ImageConfig.from_preprocessor_config(config), Qwen2VLImageProcessorPil(**config)
    assert (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size, cfg.min_pixels, cfg.max_pixels) == \
        (proc.patch_size, proc.merge_size, proc.temporal_patch_size, proc.size.shortest_edge, proc.size.longest_edge)
    assert (cfg.image_mean, cfg.image_std, cfg.resample, cfg.rescale_factor) == \
        (tuple(proc.image_mean), tuple(proc.image_std), int(proc.resample), proc.rescale_factor)


def test_config_refuses_what_it_cannot_follow():
    with pytest.raises(ValueError, match="do_normalize"):
        ImageConfig.from_preprocessor_config({**RELEASE, "do_normalize": False})
    with pytest.raises(ValueError, match="longest_edge"):
        ImageConfig.from_preprocessor_config({"size": {"shortest_edge": 1024}})


# -- digest ---------------------------------------------------------------------------------------

def test_digest_keys_the_decoded_pixels():
    im = Image.fromarray(np.random.default_rng(3).integers(0, 256, (30, 20, 3), dtype=np.uint8))
    cfg = CONFIGS[1]
    assert preprocess(png(im), cfg).digest == preprocess(im, cfg).digest  # file or pixels: one key
    bmp = io.BytesIO()
    im.save(bmp, "BMP")
    assert preprocess(bmp.getvalue(), cfg).digest == preprocess(im, cfg).digest
    changed = im.copy()
    changed.putpixel((0, 0), (0, 0, 0) if im.getpixel((0, 0)) != (0, 0, 0) else (1, 1, 1))
    assert preprocess(changed, cfg).digest != preprocess(im, cfg).digest
    # the same bytes in another shape are another image
    assert preprocess(Image.frombytes("RGB", (20, 30), im.tobytes()), cfg).digest != \
        preprocess(Image.frombytes("RGB", (30, 20), im.tobytes()), cfg).digest


# -- bad input ------------------------------------------------------------------------------------

def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height but holds a few bytes of pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def noise(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


BAD_BYTES = {
    "empty": (b"", "empty"),
    "truncated png": (noise("PNG")[:6000], "truncated"),
    "truncated jpeg": (noise("JPEG")[:3000], "truncated"),
    "not an image": (b"hello, this is text\n", "not an image"),
    "over the pixel bound": (png_header(8193, 8193), "more than the 67,108,864"),  # refused undecoded
    "pillow's bomb warning": (png_header(10000, 10000), "bomb"),
    "pillow's bomb error": (png_header(20000, 20000), "bomb"),
    "aspect ratio over 200": (png(Image.new("RGB", (1, 201))), "aspect ratio"),
}


@pytest.mark.parametrize("name", BAD_BYTES)
def test_bad_bytes_raise_naming_the_label(name):
    data, what = BAD_BYTES[name]
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[1\]: .*" + what):
        preprocess(data, ImageConfig(), label="messages[0].content[1]")


@pytest.mark.parametrize("name", [n for n in BAD_BYTES if n != "empty"] + ["missing", "directory"])
def test_bad_files_raise_naming_the_path(tmp_path, name):
    path = tmp_path / "img.png"
    if name == "directory":
        path.mkdir()
    elif name != "missing":
        path.write_bytes(BAD_BYTES[name][0])
    with pytest.raises(ImageError, match=r"^" + str(path)):
        preprocess(path, ImageConfig())


def test_empty_file_says_so(tmp_path):
    (tmp_path / "empty.png").touch()
    with pytest.raises(ImageError, match=r"empty\.png\): the file is empty"):
        preprocess(tmp_path / "empty.png", ImageConfig(), label="image 3")


def test_lazy_pil_image_of_a_truncated_file_raises():
    im = Image.open(io.BytesIO(noise("PNG")[:6000]))  # Pillow reads only the header here
    with pytest.raises(ImageError, match="^upload: .*truncated"):
        preprocess(im, ImageConfig(), label="upload")


def test_the_pixel_bound():
    assert MAX_SOURCE_PIXELS == 8192 * 8192 < Image.MAX_IMAGE_PIXELS


# -- data URLs ------------------------------------------------------------------------------------

def test_data_url_round_trips_a_png():
    data = png(Image.new("RGB", (3, 2), (9, 8, 7)))
    assert decode_data_url(data_url(data), "x") == data
    wrapped = data_url(data).replace("base64,", "base64,\n").replace("A", "A\r\n", 2)  # wrapped lines
    assert decode_data_url(" " + wrapped + "\n", "x") == data
    assert decode_data_url(data_url(data, "IMAGE/PNG").replace("data:", "DATA:"), "x") == data


@pytest.mark.parametrize("url, what", [
    ("https://example.com/cat.png", "scheme https:"),
    ("http://127.0.0.1/cat.png", "scheme http:"),
    ("file:///etc/passwd", "scheme file:"),
    ("ftp://example.com/a.png", "scheme ftp:"),
    ("/home/me/cat.png", "not a URL"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:;base64,aGVsbG8=", "no media type"),
    ("data:image/png,rawbytes", "not base64"),
    ("data:image/png;base64,iVBORw0KGgo*", "does not decode"),
    ("data:image/png;base64,iVBORw0KGgo", "does not decode"),  # padding cut off
    ("data:image/png;base64,", "no bytes"),
])
def test_data_url_refusals_name_the_label(url, what):
    with pytest.raises(ImageError, match=r"^messages\[2\]\.content\[0\]\.image_url: .*" + what) as e:
        decode_data_url(url, "messages[2].content[0].image_url")
    assert "data:" in str(e.value)
