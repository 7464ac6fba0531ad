"""Every notebook runs top to bottom (a broken notebook fails CI)."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


# 02 measures whole models (about 100 s even on its slice): the full suite's, and 01 with it
# (the quick tier runs 03, the kernels' notebook)
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if not p.name.startswith("03") else p
                                  for p in NOTEBOOKS], ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    # the kernel inherits TRITON_INTERPRET=1 from tests/conftest.py, and STRATA_NB_SLICE=1: the
    # notebooks that measure whole models (02) then run on a small slice (02: about 100 s)
    monkeypatch.setenv("STRATA_NB_SLICE", "1")
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
