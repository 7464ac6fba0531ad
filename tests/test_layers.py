"""The packages' one-way imports (ARCHITECTURE.md draws them). Each layer imports only
from the layers below it and its own; argparse, strata.cli and strata.hub (the known
models, fetched or built) belong to the command line alone. An import the wrong way
fails here, naming the file, the line and the layers."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [  # bottom first
    ("quant",),  # the formats: numpy reference codecs
    ("triton_kernels",),  # kernels and their torch twins
    ("strata.tensors", "strata.gguf", "strata.names", "strata.cache", "strata.tokenizer",
     "strata.pretokenizers"),  # files and names
    ("strata.nn", "strata.runtime", "strata.dist"),  # modules; generation over any model; several processes
    ("strata.storage", "strata.models"),  # where weights live; models as structure
    ("strata.load",),  # the plan and the loaders
    ("strata.perplexity", "strata.imatrix", "strata.imatrix_file", "strata.quantize", "strata.convert",
     "strata.server", "strata.bench", "strata.vision"),  # library tools, each with plain arguments
    ("strata.hub",),  # the known models
    ("strata.cli", "strata.__main__", "argparse"),  # the command line
]


def _layer(module: str) -> int | None:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


FILES = sorted(p for d in ("quant", "triton_kernels", "strata") for p in (ROOT / d).rglob("*.py"))


def test_every_module_has_a_layer():
    assert [str(f.relative_to(ROOT)) for f in FILES if _module(f) != "strata" and _layer(_module(f)) is None] == []


@pytest.mark.parametrize("top", ["quant", "triton_kernels", "strata"])
def test_imports_point_down(top):
    wrong = []
    for f in (f for f in FILES if _module(f).split(".")[0] == top):
        me = _layer(_module(f))
        for line, mod in _imports(f):
            there = _layer(mod)
            if me is not None and there is not None and there > me:
                wrong.append(f"{f.relative_to(ROOT)}:{line} imports {mod} (layer {there}: {LAYERS[there][0]}) "
                             f"from layer {me} ({LAYERS[me][0]})")
    assert not wrong, "\n".join(wrong)


def test_a_wrong_import_is_caught():
    """The rule itself: a storage module importing the CLI is an upward import."""
    assert _layer("strata.storage.experts") < _layer("strata.cli.args")
    assert _layer("strata.models.llama") < _layer("strata.load.plan") < _layer("strata.hub")
    assert _layer("argparse") == len(LAYERS) - 1


def test_every_strata_module_fits_500_lines():
    """A module over 500 lines holds more than one thing: split it by what it holds."""
    long = [f"{f.relative_to(ROOT)}: {n} lines" for f in (ROOT / "strata").rglob("*.py")
            if (n := len(f.read_text().splitlines())) > 500]
    assert not long, long
