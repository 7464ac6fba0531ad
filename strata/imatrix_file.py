"""llama.cpp's GGUF imatrix file (tools/imatrix/imatrix.cpp's save_imatrix), numpy alone:
`strata quantize --imatrix` reads it without importing torch. strata.imatrix computes one."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class IMatrix:
    """Raw sums, as the file holds them: `sums[name]` (n_mat, in) and `counts[name]` (n_mat,)."""
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    ppl: float | None = None  # PPL of the chunks, scored as llama-perplexity does

    def mean_sq(self) -> dict[str, np.ndarray]:
        """Mean squared activation per input column, as llama-quantize computes it from the
        file: in_sum2 / count, and 1 where a matrix saw no tokens (an unused expert)."""
        out = {}
        for name, s in self.sums.items():
            c = self.counts[name].astype(np.float32)[:, None]
            m = np.where(c > 0, s / np.where(c > 0, c, 1), np.float32(1)).astype(np.float32)
            out[name] = m[0] if m.shape[0] == 1 else m
        return out


# -- the file --------------------------------------------------------------------------------

def write_imatrix(path: str | Path, im: IMatrix) -> Path:
    """imatrix.cpp's save_imatrix layout (strata.imatrix's docstring describes it)."""
    from gguf import GGUFWriter
    path = Path(path)
    if not im.datasets:  # and gguf-py cannot write an empty array
        raise ValueError(f"write_imatrix({path}): name the text(s) the matrix was computed on in "
                         "IMatrix.datasets: llama-quantize refuses a file without imatrix.datasets")
    tmp = path.with_name(path.name + ".partial")
    w = GGUFWriter(tmp, arch="")  # gguf-py skips an empty string: no general.architecture, as imatrix.cpp
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", [str(d) for d in im.datasets])
    w.add_uint32("imatrix.chunk_count", im.chunk_count)
    w.add_uint32("imatrix.chunk_size", im.chunk_size)
    for name in sorted(im.sums):
        s = np.ascontiguousarray(im.sums[name], dtype=np.float32)
        if s.ndim != 2 or np.size(im.counts[name]) != s.shape[0]:
            raise ValueError(f"write_imatrix({path}): {name!r} has sums of shape {s.shape} and "
                             f"{np.size(im.counts[name])} counts; (n_mat, in) and n_mat expected")
        c = np.asarray(im.counts[name], dtype=np.float32).reshape(s.shape[0], 1)
        if s.shape[0] == 1:  # ggml writes n_dims without trailing 1s: ne [in] and [1]
            s, c = s[0], c[0]
        w.add_tensor(f"{name}.in_sum2", s)  # torch order (n_mat, in): ne [in, n_mat]
        w.add_tensor(f"{name}.counts", c)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_imatrix(path: str | Path) -> IMatrix:
    """An imatrix GGUF file, from llama-imatrix or `strata imatrix`."""
    from strata.gguf import open_gguf
    g = open_gguf(path)
    if g.get("general.type") != "imatrix":
        raise ValueError(f"{path}: general.type is {g.get('general.type')!r}, not 'imatrix': "
                         "not an importance matrix (llama-imatrix's old .dat format is not read)")
    im = IMatrix(datasets=list(g.get("imatrix.datasets") or []),
                 chunk_count=int(g.get("imatrix.chunk_count", 0)),
                 chunk_size=int(g.get("imatrix.chunk_size", 0)))
    for tname, t in g.tensors.items():
        if not tname.endswith(".in_sum2"):
            continue
        name = tname[:-len(".in_sum2")]
        counts = g.tensors.get(f"{name}.counts")
        if counts is None:
            raise ValueError(f"{path}: tensor {tname!r} has no {name}.counts beside it")
        if t.fmt.name != "F32" or counts.fmt.name != "F32":
            raise ValueError(f"{path}: {tname!r} and {name}.counts must be F32, are "
                             f"{t.fmt.name} and {counts.fmt.name}")
        s = t.numpy().reshape(-1, t.shape[-1])
        c = np.rint(counts.numpy().reshape(-1)).astype(np.int64)
        if c.size != s.shape[0]:
            raise ValueError(f"{path}: {name}.counts has {c.size} entries for {s.shape[0]} matrices")
        im.sums[name], im.counts[name] = s, c
    orphans = [n for n in g.tensors if n.endswith(".counts") and n[:-len(".counts")] not in im.sums]
    if orphans:
        raise ValueError(f"{path}: {orphans[0]!r} has no .in_sum2 beside it")
    if not im.sums:
        raise ValueError(f"{path}: no <weight>.in_sum2 tensors: the importance matrix is empty")
    return im


def load_imatrix(path: str | Path) -> dict[str, np.ndarray]:
    """Weight name (blk.N.ffn_down.weight, ...) -> mean squared activation per input column,
    float32 (in,) (or (n_experts, in)): what llama-quantize hands its quantizers."""
    return read_imatrix(path).mean_sq()
