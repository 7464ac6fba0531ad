"""The packages' one-way imports: quant (the formats) imports neither the kernels nor the
engine; triton_kernels imports nothing of the engine; strata.convert does not reach back
into strata.hub (which builds flash-tiny with it). An import the wrong way fails here,
naming the file and the line."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RULES = [  # (files, packages they must not import)
    ("quant", ("triton_kernels", "strata")),
    ("triton_kernels", ("strata",)),
    ("strata/convert", ("strata.hub",)),
]


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


@pytest.mark.parametrize("where,banned", RULES, ids=[r[0] for r in RULES])
def test_imports_point_one_way(where, banned):
    files = sorted((ROOT / where).rglob("*.py"))
    assert files
    wrong = [f"{f.relative_to(ROOT)}:{line} imports {mod}" for f in files for line, mod in _imports(f)
             if any(mod == b or mod.startswith(b + ".") for b in banned)]
    assert not wrong, "\n".join(wrong)
