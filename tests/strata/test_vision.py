"""flash-tiny-vision with images, against transformers' Qwen4ExpForConditionalGeneration.

Both run float32 on the same pixel values (Strata's preprocessing, which
test_vision_preprocess.py holds to transformers' processor within 1e-6). The bound, 1e-4 of
the largest logit, is the one the text model meets: the two sum in different orders
(SDPA, the chunked DeltaNet), and measured differences are near 5e-7.
"""
from __future__ import annotations

import base64
import io
import re
import subprocess
import sys
import zlib

import numpy as np
import openai
import pytest
import torch
from PIL import Image as PILImage

from strata.hub import flash_tiny_checkpoint, synth_flash_tiny
from strata.load import load_model
from strata.names.qwen4exp import mmproj_sidecar
from strata.tokenizer import Tokenizer
from strata.vision.images import MARKER, Vision, flatten
from strata.vision.preprocess import ImageError

REL = 1e-4


@pytest.fixture(scope="module")
def path():
    return synth_flash_tiny(quiet=True, vision=True)


@pytest.fixture(scope="module")
def model(path):
    return load_model(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def tok(path):
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def vision(model, tok, path):
    return Vision.load(model, tok, mmproj_sidecar(path))


@pytest.fixture(scope="module")
def hf(path):
    from transformers import Qwen4ExpForConditionalGeneration
    return Qwen4ExpForConditionalGeneration.from_pretrained(flash_tiny_checkpoint(vision=True),
                                                            dtype=torch.float32).eval()


def png(h: int, w: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _prompt(tok, vision, messages):
    messages, sources = flatten(messages, local=True)
    images = [vision.read(src, label) for src, label in sources]
    return vision.expand(tok.encode(tok.apply_chat_template(messages)), images), images


def _theirs(hf, ids, images):
    t = torch.tensor([ids])
    with torch.no_grad():
        return hf(input_ids=t, pixel_values=torch.cat([im.pixels.values for im in images]),
                  image_grid_thw=torch.tensor([im.pixels.grid_thw for im in images]),
                  mm_token_type_ids=(t == hf.config.image_token_id).int(), use_cache=False).logits[0]


def _ours(model, vision, ids, images, chunk=64):
    state = model.new_cache()
    vision.prepare(state, ids, images)
    return torch.cat([model(ids[i:i + chunk], state) for i in range(0, len(ids), chunk)]), state


def test_the_tower_equals_transformers(hf, vision):
    image = vision.read(png(70, 130, 0), "a")
    with torch.no_grad():
        theirs = hf.model.visual(image.pixels.values, grid_thw=torch.tensor([image.pixels.grid_thw])).pooler_output
    assert image.grid == (6, 11)  # lifted to the minimum pixels: 192 x 352
    assert _rel(vision.encode(image), theirs) < 1e-5


def test_the_tower_equals_transformers_where_attention_is_sharp(hf, vision):
    """Weights of N(0, 0.02) make every attention nearly uniform and small beside the
    residual, which hides the 2-D RoPE; with both towers' queries and keys made 40x larger
    and their values and output projections 30x, it decides the output."""
    import copy
    from strata.models.vision import VisionTower
    ours, theirs = VisionTower.load(vision.path), copy.deepcopy(hf.model.visual)
    dim = ours.cfg.dim
    with torch.no_grad():
        for i, block in enumerate(theirs.blocks):
            for part in ("weight", "bias"):
                for t in (getattr(block.attn.qkv, part), ours.w[f"v_blk_{i}_attn_qkv_{part}"]):
                    t[:2 * dim] *= 40
                    t[2 * dim:] *= 30
                for t in (getattr(block.attn.proj, part), ours.w[f"v_blk_{i}_attn_out_{part}"]):
                    t *= 30
        image = vision.read(png(70, 130, 0), "a")
        want = theirs(image.pixels.values, grid_thw=torch.tensor([image.pixels.grid_thw])).pooler_output
        assert _rel(ours(image.pixels.values, image.pixels.grid_thw), want) < 1e-5
        assert _rel(vision.encode(image), want) > 1e-2  # the sharpening changed the output


ONE = [{"role": "user", "content": [{"type": "image", "image": png(90, 120, 1)},
                                    {"type": "text", "text": "What is in the picture?"}]}]
TWO = [{"role": "user", "content": [{"type": "text", "text": "Compare"},
                                    {"type": "image", "image": png(300, 200, 2)},
                                    {"type": "text", "text": "with"},
                                    {"type": "image", "image": png(64, 64, 3)}]}]
TURNS = [{"role": "user", "content": "Hello, I will show you something."},
         {"role": "assistant", "content": "Please do."},
         {"role": "user", "content": [{"type": "image", "image": png(100, 260, 4)},
                                      {"type": "text", "text": "This. And now?"}]},
         {"role": "assistant", "content": "A pattern of noise."},
         {"role": "user", "content": "Thank you; describe it once more in other words, please."}]


@pytest.mark.parametrize("messages", [ONE] + [pytest.param(m, marks=pytest.mark.slow) for m in (TWO, TURNS)],
                         ids=["one-image", "two-images", "between-turns"])
def test_logits_equal_transformers(model, tok, vision, hf, messages):
    ids, images = _prompt(tok, vision, messages)
    assert sum(t == model.cfg.image_token for t in ids) == sum(im.n_tokens for im in images)
    ours, state = _ours(model, vision, ids, images)
    assert _rel(ours, _theirs(hf, ids, images)) < REL
    # and the decode after it, at the position after the image's
    nxt = int(ours[-1].argmax())
    assert _rel(model([nxt], state)[-1], _theirs(hf, ids + [nxt], images)[-1]) < REL


def test_images_move_the_text_positions(model, tok, vision):
    """The same tokens and rows with index positions give other logits: the M-RoPE
    positions are what transformers' agree with, not an accident of the test."""
    ids, images = _prompt(tok, vision, ONE)
    ours, _ = _ours(model, vision, ids, images)
    state = model.new_cache()
    vision.prepare(state, ids, images)
    state.positions.rows = None  # every position its index again
    flat = torch.cat([model(ids[i:i + 64], state) for i in range(0, len(ids), 64)])
    assert _rel(flat, ours) > 1e-3


def test_an_image_needs_its_place(tok, vision):
    image = vision.read(png(40, 40, 5), "a")
    with pytest.raises(ValueError, match="image"):
        vision.expand(tok.encode("no place for it"), [image])
    ids = vision.expand(tok.encode(MARKER + "x"), [image])
    with pytest.raises(ValueError, match="runs of"):
        vision.model.add_images(vision.model.new_cache(), ids[:-3], [(None, image.grid)] * 2, vision.pad)


def _engine(model, tok, vision, align: int = 64):
    from strata.server.engine import Engine
    return Engine(model, tok, slots=1, start_thread=False, vision=vision, align=align)


def _answer(engine, tok, vision, messages):
    from strata.runtime.sampling import SamplingParams
    from strata.server.engine import Request
    ids, images = _prompt(tok, vision, messages)
    req = Request(ids, SamplingParams(temperature=0, max_tokens=4), emit=lambda ev: None, images=images,
                  key=vision.key(ids, images) if images else None)
    engine.submit(req)
    engine.run(until_idle=True)
    return req


# a first turn long enough that the cache keeps a chunk past its image
FIRST = TURNS[:2] + [{"role": "user", "content": [{"type": "image", "image": png(100, 260, 4)},
                                                  {"type": "text", "text": "Look at it closely. " * 12}]}]
NEXT = FIRST + [{"role": "assistant", "content": "A pattern."},
                {"role": "user", "content": [{"type": "image", "image": png(64, 64, 3)},
                                             {"type": "text", "text": "And this?"}]}]


@pytest.mark.slow
def test_a_later_turn_reuses_an_earlier_image_from_the_cache(model, tok, vision):
    engine = _engine(model, tok, vision)
    first = _answer(engine, tok, vision, FIRST)
    second = _answer(engine, tok, vision, NEXT)
    end_of_first_image = max(i for i, t in enumerate(first.prompt) if t == vision.pad) + 1
    assert second.cached_tokens >= end_of_first_image   # the first image is not run again
    alone = _answer(_engine(model, tok, vision), tok, vision, NEXT)
    assert alone.cached_tokens == 0 and alone.tokens == second.tokens


@pytest.mark.slow
def test_text_after_an_image_request_takes_nothing_of_its_plan(model, tok, vision):
    """A cached prefix cut before an earlier request's image holds none of its rows or
    positions: a text-only prompt that shares the prefix answers as on a fresh engine."""
    system = {"role": "system", "content": "You describe things. " * 40}
    engine = _engine(model, tok, vision, align=128)
    _answer(engine, tok, vision, [system] + ONE)
    text = [system, {"role": "user", "content": "What is a picture?"}]
    shared = _answer(engine, tok, vision, text)
    assert shared.cached_tokens >= 128
    assert shared.tokens == _answer(_engine(model, tok, vision, align=128), tok, vision, text).tokens


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata", "generate", "--model", "flash-tiny-vision", "--dtype",
                           "f32", "-t", "1", "--temperature", "0", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow  # the quick tier generates with an image in `described` below
def test_generate_with_images_names_the_tower(path, tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(png(90, 120, 1))
    b.write_bytes(png(64, 64, 3))
    r = _cli("Describe them.", "--image", str(a), "--image", str(b), "-n", "4")
    assert r.returncode == 0, r.stderr
    assert "vision: mmproj-flash-tiny-vision.f32.gguf" in r.stderr
    # two images of 7 x 9 and 4 x 4 merged patches (the minimum pixels lift both), and the text
    assert "4 generated" in r.stderr


@pytest.fixture(scope="module")
def described(path, tmp_path_factory):
    """`strata generate "Describe them." --image a.png -n 4`, greedy, f32: (the image's path, the run)."""
    a = tmp_path_factory.mktemp("images") / "a.png"
    a.write_bytes(png(90, 120, 1))
    run = _cli("Describe them.", "--image", str(a), "-n", "4")
    assert run.returncode == 0, run.stderr
    return a, run


@pytest.mark.slow  # the quick tier shows images through generate and the server
def test_chat_shows_an_image_with_the_next_line(described, tmp_path):
    a, gen = described
    chat = subprocess.run([sys.executable, "-m", "strata", "chat", "--model", "flash-tiny-vision", "--dtype", "f32",
                           "-t", "1", "--temperature", "0", "-n", "4"],
                          input=f"/image {tmp_path / 'nothing.png'}\n/image {a}\nWhat is <|image_pad|>?\n"
                                "Describe them.\n",
                          capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr
    assert "nothing.png: no such file" in chat.stderr      # said, and the chat goes on
    assert "70 image tokens, shown with your next line" in chat.stderr
    assert "names 2 image(s)" in chat.stderr  # a line that names a place of its own is refused, and
    # its image waits for the next
    assert chat.stdout.strip() == gen.stdout.strip() != ""


def huge_png(side: int = 20000) -> bytes:
    """A small PNG whose header says side x side: refused before any pixel is decoded."""
    raw = bytearray(png(1, 1, 0))
    raw[16:24] = side.to_bytes(4, "big") * 2       # IHDR's width and height
    raw[29:33] = zlib.crc32(bytes(raw[12:29])).to_bytes(4, "big")
    return bytes(raw)


BAD = {
    "empty": b"",
    "truncated": png(90, 120, 1)[:200],
    "not-an-image": b"%PDF-1.4 not a picture at all",
    "enormous": huge_png(),
}


@pytest.mark.parametrize("kind", ["truncated", pytest.param("missing", marks=pytest.mark.slow)])
def test_generate_refuses_a_bad_image_in_one_line(kind, tmp_path):
    f = tmp_path / f"{kind}.png"
    if kind != "missing":
        f.write_bytes(BAD[kind])
    r = _cli("x", "--image", str(f), "-n", "1")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"strata: {f}: ") and last.count(str(f)) == 1, r.stderr[-1000:]
    assert "Traceback" not in r.stderr
    assert "plan:" not in r.stderr  # refused before the model loads


@pytest.mark.parametrize("kind", BAD)
def test_a_bad_image_file_is_named(vision, kind, tmp_path):
    # the same path `strata generate --image` and `/image` take (the CLI's one line is above)
    f = tmp_path / f"{kind}.png"
    f.write_bytes(BAD[kind])
    with pytest.raises(ImageError, match=f"^{re.escape(str(f))}: "):
        vision.read(str(f))


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def server(path):
    from tests.strata.test_server import Server
    s = Server("--model", "flash-tiny-vision", "--slots", "1")
    yield s
    s.stop()


def _ask(server, image: bytes, text: str = "Describe them.", n: int = 4):
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": text}]
    return server.client.chat.completions.create(model="flash-tiny-vision", messages=[{"role": "user", "content": parts}],
                                                 max_tokens=n, temperature=0)


def test_the_server_sees_what_generate_sees(server, described):
    a, cli = described
    r = _ask(server, a.read_bytes())
    assert cli.stdout.strip() == r.choices[0].message.content.strip()
    assert "vision: mmproj-flash-tiny-vision.f32.gguf" in cli.stderr
    assert r.usage.prompt_tokens_details.image_tokens == 7 * 10  # 90 x 120 lifted to 224 x 320 pixels
    assert "prompt tokens" in cli.stderr and f"{r.usage.prompt_tokens} prompt tokens" in cli.stderr


def test_the_conversation_cache_keys_images_by_content(server):
    a, b = png(90, 120, 1), png(90, 120, 2)   # the same size: the same tokens, other pixels
    first = _ask(server, a, "Look closely at this picture, then describe every part of it in detail.")
    again = _ask(server, a, "Look closely at this picture, then describe every part of it in detail.")
    other = _ask(server, b, "Look closely at this picture, then describe every part of it in detail.")
    # the prompt's whole chunks of 64 reused; the last ends inside the image, whose rows
    # past it the tower gives again
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens // 64 * 64 > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    assert other.usage.prompt_tokens_details.cached_tokens == 0        # nothing reused past another image


@pytest.mark.parametrize("url, words", [
    (data_url(BAD["truncated"]), "truncated"),
    (data_url(b""), "no bytes"),
    (data_url(BAD["not-an-image"]), "not an image"),
    (data_url(huge_png()), "pixels"),
    ("https://example.com/cat.png", "data: URL"),
    ("file:///etc/passwd", "data: URL"),
    ("data:image/png;base64,@@@@", "base64"),
])
def test_a_bad_image_gets_400_naming_the_part(server, url, words):
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model="flash-tiny-vision", messages=[{"role": "user", "content": parts}],
                                              max_tokens=1)
    message = e.value.body["message"]
    assert "messages[0].content[1]" in message and words.lower() in message.lower(), message
    assert _ask(server, png(40, 40, 6), n=1).choices[0].finish_reason in ("stop", "length")


def test_the_server_reads_no_file_of_its_own(server, tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(png(40, 40, 7))
    for part in ({"type": "image", "image": str(secret)}, {"type": "image_url", "image_url": {"url": str(secret)}},
                 {"type": "image_url", "image_url": {"url": f"file://{secret}"}}):
        with pytest.raises(openai.BadRequestError) as e:
            server.client.chat.completions.create(model="flash-tiny-vision", max_tokens=1,
                                                  messages=[{"role": "user", "content": [part]}])
        assert e.value.body["message"].startswith("messages[0].content[0]: "), e.value.body
