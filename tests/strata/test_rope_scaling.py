"""RoPE scaling (`--rope-scaling yarn|linear --rope-scale S`) and the context it allows.

flash-tiny is told it was trained on 64 tokens and stretched 4x, so the 300-token prompt
runs past its "original" context, where YaRN's interpolated frequencies and its attention
factor decide the logits; transformers 5.23 with the same rope_parameters is the
reference. Tolerance 2e-6 relative to the largest |logit|, as the unscaled parity tests in
test_qwen4exp.py: both sides compute in float32 and differ in summation order only (and in
the inverse frequencies' precision: float64 here, float32 in transformers, 1e-7 relative).
A ramp off by one dimension, a missing attention factor, or the factor applied to the
wrong side of the ramp each give 1e-3 or more.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from strata.gguf import open_gguf  # noqa: E402
from strata.hub import flash_tiny_checkpoint  # noqa: E402
from strata.load import Options, decide, load_model  # noqa: E402
from strata.nn.rope import Rope, RopeScaling  # noqa: E402

from .test_qwen4exp import REL, _hf, _rel  # noqa: E402

ORIG, SCALE = 64, 4.0


@pytest.fixture(scope="module")
def tiny(flash_tiny_gguf):
    return flash_tiny_gguf.path


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 49152, (300,), generator=g)
    ids[0] = ids[170] = 2  # EOS: the n-gram hash restarts
    return ids


def _reference(prompt, kind: str) -> torch.Tensor:
    from transformers import AutoConfig
    path = flash_tiny_checkpoint()
    rp = dict(AutoConfig.from_pretrained(path).rope_parameters)
    rp.update(rope_type=kind, factor=SCALE, original_max_position_embeddings=ORIG)
    with torch.no_grad():
        return _hf(path, rope_parameters=rp)(prompt[None], use_cache=False).logits[0]


@pytest.fixture(scope="module")
def yarn(tiny):
    return load_model(tiny, dtype=torch.float32, rope_scaling="yarn", rope_scale=SCALE, yarn_orig_ctx=ORIG)


@pytest.mark.slow
def test_yarn_equals_transformers_past_the_original_context(yarn, prompt):
    assert prompt.numel() > ORIG
    ref = _reference(prompt, "yarn")
    assert _rel(yarn(prompt, yarn.new_cache()), ref) < REL
    # token by token past the original context, after a chunk within it
    state = yarn.new_cache()
    outs = [yarn(prompt[:50], state)] + [yarn(prompt[i:i + 1], state) for i in range(50, 80)]
    assert _rel(torch.cat(outs), ref[:80]) < REL


@pytest.mark.slow
def test_linear_scaling_equals_transformers(tiny, prompt, yarn):
    m = load_model(tiny, dtype=torch.float32, rope_scaling="linear", rope_scale=SCALE)
    out = m(prompt, m.new_cache())
    assert _rel(out, _reference(prompt, "linear")) < REL
    # the parities would hold vacuously if the scalings did nothing past 64 tokens
    assert _rel(yarn(prompt, yarn.new_cache()), out) > 1e-3


def test_yarn_keeps_high_frequencies_and_interpolates_low_ones():
    base = Rope(32, 10000.0, max_pos=8)
    s = RopeScaling("yarn", 8.0, 4096)
    y = Rope(32, 10000.0, max_pos=8, scaling=s)
    ratio = y.inv_freq / base.inv_freq
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(1 / 8)       # fastest kept, slowest / factor
    assert bool((ratio[1:] <= ratio[:-1]).all())                        # a monotone ramp between
    assert y.cos[0, 0] == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1.0)  # mscale
    assert Rope(32, 10000.0, 8, RopeScaling("linear", 2.0, 4096)).inv_freq.allclose(base.inv_freq / 2)


def test_the_plan_reads_the_file_and_the_flags(tiny):
    g = open_gguf(tiny)
    trained = int(g.get(f"{g.arch}.context_length"))
    p = decide(g, Options())
    assert p.rope is None and p.context == trained
    assert any(line.startswith(f"context: {trained} tokens") for line in p.lines(drive=False))
    p = decide(g, Options(rope_scaling="yarn", rope_scale=1.5))
    assert p.rope == RopeScaling("yarn", 1.5, trained) and p.context == int(trained * 1.5)
    assert "RoPE yarn x1.5" in "\n".join(p.lines(drive=False))
    p = decide(g, Options(max_context=3 * trained))
    assert p.context == 3 * trained and f"past the {trained}" in p.context_why
    with pytest.raises(ValueError, match="--rope-scale"):
        decide(g, Options(rope_scaling="yarn"))


def test_a_file_with_rope_scaling_keys_is_scaled(tiny, tmp_path):
    from strata.gguf import write_gguf
    g = open_gguf(tiny)
    a = g.arch
    meta = g.typed_metadata()
    meta.update({f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": 2.0,
                 f"{a}.rope.scaling.original_context_length": 1024})
    out = write_gguf(tmp_path / "yarn.gguf", a, meta, g.tensors)
    p = decide(open_gguf(out), Options())
    assert p.rope == RopeScaling("yarn", 2.0, 1024) and p.context == 2048
    assert decide(open_gguf(out), Options(rope_scaling="none")).rope is None


def test_the_server_bound_is_the_planned_context(yarn):
    from strata.server.engine import Engine
    assert yarn.max_context == int(ORIG * SCALE)
    assert Engine(yarn, tokenizer=None, start_thread=False).ctx_size == int(ORIG * SCALE)
