"""The expert pack that `strata pack` writes for the packed expert tiers: experts.bin (per
layer, expert after expert, each expert's gate, up and down blocks adjacent and starting on
a page, so one expert is one read) and experts.txt, a text index of where each tensor sits
in experts.bin and came from in its GGUF (`pack` writes both, `Pack.open` reads them).
"""
from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from pathlib import Path

from strata.gguf.shards import shard_files
from strata.names.qwen4exp import EXPERT_TENSOR, mtp_sidecar
from strata.storage import io
from strata.storage.expert_sources import tensor_file
from strata.storage.io import PAGE
from strata.tensors import QTensor

PACK_BIN, PACK_INDEX = "experts.bin", "experts.txt"
PACK_ALIGN = PAGE  # each expert starts on a page: a direct read of one expert wastes no page
EXPERT_TENSORS = ("gate", "up", "down")


def default_pack_dir(gguf: str | os.PathLike) -> Path:
    """Where `strata pack` writes without --out: packs/<file stem> in the Strata cache."""
    from strata.cache import cache_dir
    return cache_dir() / "packs" / Path(gguf).name.removesuffix(".gguf")


@dataclass(frozen=True)
class PackEntry:
    layer: int
    tensor: str  # gate, up or down
    name: str
    fmt: str
    shape: tuple[int, ...]
    gguf_offset: int
    expert_bytes: int
    packed_offset: int
    stride: int  # bytes from one expert to the next in experts.bin
    gguf_size: int
    gguf: str


_INDEX_HEAD = """\
# Strata expert pack, version 1.
# experts.bin holds the routed experts layer by layer, expert after expert; each expert's
# gate, up and down blocks sit back to back (one read an expert), and each expert starts on
# a {align}-byte boundary. Expert e of a tensor is at packed_offset + e * stride in
# experts.bin, and at gguf_offset + e * expert_bytes in its GGUF file. Tab-separated.
"""
_COLUMNS = ("layer", "tensor", "name", "format", "shape", "gguf_offset", "expert_bytes",
            "packed_offset", "stride", "gguf_size", "gguf")


class Pack:
    """An opened pack: `bin` (experts.bin), `index` (experts.txt), entries by tensor name."""

    def __init__(self, index: Path, entries: dict[str, PackEntry]):
        self.index, self.bin, self.entries = index, index.with_name(PACK_BIN), entries

    @classmethod
    def open(cls, where: str | os.PathLike) -> Pack:
        where = Path(where)
        index = where / PACK_INDEX if where.is_dir() or not where.suffix else where
        if not index.is_file() or not index.with_name(PACK_BIN).is_file():
            raise ValueError(f"{where}: no expert pack ({PACK_BIN} and {PACK_INDEX}); write one with "
                             f"`strata pack MODEL.gguf --out {where}`, or pass --experts-dir")
        return _open_pack(str(index.resolve()), index.stat().st_mtime_ns)

    def entry(self, t: QTensor) -> PackEntry:
        ent = self.entries.get(t.name)
        if ent is None:
            raise ValueError(f"{self.index}: no entry for tensor {t.name!r}; this pack is of another "
                             f"model: run `strata pack` on this one")
        path, offset = tensor_file(t)
        size = path.stat().st_size
        if (ent.fmt, ent.shape, ent.expert_bytes) != (t.fmt.name, tuple(t.shape), t.nbytes // t.shape[0]) \
                or ent.gguf_size != size or ent.gguf_offset != offset:
            raise ValueError(f"{self.index}: tensor {t.name!r} was packed from {ent.gguf} ({ent.fmt} "
                             f"{ent.shape}, file of {ent.gguf_size:,} bytes, offset {ent.gguf_offset}) "
                             f"but {path} has {t.fmt.name} {tuple(t.shape)}, {size:,} bytes, offset "
                             f"{offset}: the pack is stale; run `strata pack {path} --out {self.index.parent}`")
        return ent


_packs: dict[tuple, Pack] = {}


def _open_pack(index: str, mtime: int) -> Pack:
    """Parsed once per index file (and version of it), however many layers ask."""
    key = (index, mtime)
    if key not in _packs:
        entries = {}
        with open(index) as f:
            for n, line in enumerate(f, 1):
                if not line.strip() or line.startswith("#"):
                    continue
                cols = line.rstrip("\n").split("\t")
                if cols[0] == "layer":  # the header row
                    continue
                if len(cols) != len(_COLUMNS):
                    raise ValueError(f"{index}:{n}: {len(cols)} columns, expected {len(_COLUMNS)} "
                                     f"({' '.join(_COLUMNS)}); run `strata pack` again")
                try:
                    ent = PackEntry(int(cols[0]), cols[1], cols[2], cols[3], tuple(int(s) for s in cols[4].split("x")),
                                    *(int(c) for c in cols[5:10]), cols[10])
                except ValueError:
                    raise ValueError(f"{index}:{n}: cannot read {line.strip()!r}; run `strata pack` again") from None
                entries[ent.name] = ent
        _packs[key] = Pack(Path(index), entries)
    return _packs[key]


def _expert_tensors(gguf: Path) -> dict[int, dict[str, QTensor]]:
    """Layer -> {gate, up, down} expert tensors of a GGUF, the other shards of its set and
    its MTP sidecar (whose block is a layer after the last: its experts load as the others)."""
    from strata.gguf import open_gguf
    layers: dict[int, dict[str, QTensor]] = collections.defaultdict(dict)
    side = mtp_sidecar(gguf)
    for p in shard_files(gguf) + ([side] if side.is_file() else []):
        if not p.is_file():
            raise ValueError(f"{gguf}: shard {p.name} of its set is missing")
        for name, t in open_gguf(p).tensors.items():
            mm = EXPERT_TENSOR.match(name)
            if mm:
                layers[int(mm[1])][mm[2]] = t
    for i, d in layers.items():
        if set(d) != set(EXPERT_TENSORS):
            raise ValueError(f"{gguf}: layer {i} has expert tensors {sorted(d)}, not gate, up and down")
    return dict(sorted(layers.items()))


def pack(gguf: str | os.PathLike, out: str | os.PathLike | None = None, say=io.log) -> Path:
    """Write experts.bin and its index experts.txt for a GGUF's routed experts into `out`
    (default `default_pack_dir`); returns the index's path. Both appear complete or not at
    all: they are written beside and renamed into place."""
    gguf = Path(gguf)
    layers = _expert_tensors(gguf)
    if not layers:
        raise ValueError(f"{gguf}: no routed expert tensors (blk.N.ffn_gate_exps.weight ...): nothing to pack")
    out = Path(out) if out is not None else default_pack_dir(gguf)
    out.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_idx = out / (PACK_BIN + ".partial"), out / (PACK_INDEX + ".partial")
    rows = []
    t0, pos = time.perf_counter(), 0
    try:
        with open(tmp_bin, "wb") as f:
            for i, d in layers.items():
                ts = [d[k] for k in EXPERT_TENSORS]
                E = ts[0].shape[0]
                if any(t.shape[0] != E for t in ts):
                    raise ValueError(f"{gguf}: layer {i}'s expert tensors disagree on the expert count "
                                     f"({', '.join(f'{t.name} {t.shape}' for t in ts)})")
                per = [t.nbytes // E for t in ts]
                stride = -(-sum(per) // PACK_ALIGN) * PACK_ALIGN
                views = [t.data.reshape(E, -1) for t in ts]
                pad = bytes(stride - sum(per))
                for e in range(E):
                    f.writelines(memoryview(v[e]) for v in views)
                    f.write(pad)
                at = pos
                for kind, t, n in zip(EXPERT_TENSORS, ts, per):
                    path, offset = tensor_file(t)
                    rows.append((i, kind, t.name, t.fmt.name, "x".join(map(str, t.shape)), offset, n, at, stride,
                                 path.stat().st_size, str(path.resolve())))
                    at += n
                pos += E * stride
        with open(tmp_idx, "w") as f:
            f.write(_INDEX_HEAD.format(align=PACK_ALIGN))
            f.write("\t".join(_COLUMNS) + "\n")
            f.writelines("\t".join(map(str, r)) + "\n" for r in rows)
        os.replace(tmp_bin, out / PACK_BIN)
        os.replace(tmp_idx, out / PACK_INDEX)
    except BaseException:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
        raise
    say(f"strata: packed {len(layers)} layers of experts of {gguf.name} ({pos / 2**30:.2f} GiB) into "
        f"{out / PACK_BIN} in {time.perf_counter() - t0:.1f} s; index {out / PACK_INDEX}")
    return out / PACK_INDEX
