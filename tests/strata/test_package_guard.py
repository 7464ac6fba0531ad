"""`strata` refuses to run when `import triton_kernels` finds someone else's package."""
import os
import subprocess
import sys
from pathlib import Path

import triton_kernels


def test_our_kernels_carry_the_marker():
    assert triton_kernels.__strata__ is True


def test_a_foreign_triton_kernels_is_refused_with_a_remedy(tmp_path: Path):
    fake = tmp_path / "triton_kernels"
    fake.mkdir()
    (fake / "__init__.py").write_text("# another package of the same import name\n")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(repo)]))
    # run from tmp_path: `python -c` puts the working directory first on sys.path
    proc = subprocess.run([sys.executable, "-c", "import strata"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "found another package of that name at" in proc.stderr
    assert str(fake) in proc.stderr
    assert "pip uninstall triton_kernels" in proc.stderr
