"""flash-shape built in memory: Qwen3.8-Flash-Next's real widths in random blocks, as a
MemoryGGUF the loaders read as they read the written files (strata.convert.flash_shape:
the same tensors, metadata and bytes), with no file. `strata bench model -m
flash-shape[:LAYERS]` measures the real shape on a machine whose drive could not hold it.

Each tensor's blocks are made when the loader reads that tensor and handed to it: the
loader copies them where the plan puts them (the device, pinned host memory, the CPU's
own layout) and the host's copy goes, so the host holds one tensor at a time beyond what
the plan keeps there. Without the MTP block (nothing here drafts) and without the
tokenizer (the bench feeds token ids)."""
from __future__ import annotations

from gguf import GGUFValueType

from strata.gguf import MemoryGGUF
from strata.names import qwen4exp as n

from .flash_shape import REAL, SEED, Shape, metadata, tensor_specs
from .flash_shape_blocks import tensor_data

# the end-of-turn id the written files' tokenizer gives (SmolLM2's <|im_end|>): the PLE
# hash restarts its n-grams after it
EOS = 2
DEFAULT_LAYERS = 48


def flash_shape_memory(layers: int = DEFAULT_LAYERS, rows: int = REAL["ple_rows"], *, experts: int = REAL["experts"],
                       top_k: int = REAL["top_k"], vocab: int = REAL["vocab"], seed: int = SEED) -> MemoryGGUF:
    """flash-shape of `layers` layers and a PLE table of `rows` rows, in memory (the counts
    `experts`, `top_k`, `vocab` a test may shrink; every width real)."""
    s = Shape(layers, rows, experts, vocab, top_k)
    main, ple, _mtp = tensor_specs(s)
    specs = {x.name: x for x in [*main, ple]}
    md = [("general.architecture", n.ARCH, GGUFValueType.STRING), *metadata(s, EOS)]
    return MemoryGGUF(f"{s.stem} (in memory)", md, {k: (x.fmt, x.shape) for k, x in specs.items()},
                      lambda name: tensor_data(specs[name], seed))
