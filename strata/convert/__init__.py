"""`strata convert`: Hugging Face checkpoints to GGUF.

    strata convert HF_DIR OUT.gguf [--outtype f32|f16|bf16|q8_0] [--mmproj]

Qwen3.8-Flash-Next (`Qwen4ExpForCausalLM`) only, written as llama.cpp's converter writes
it (see qwen4exp.py for the tensor table and the MTP sidecar). With --mmproj, the vision
tower of a `Qwen4ExpForConditionalGeneration` checkpoint goes to `mmproj-<OUT name>` beside
OUT, as llama.cpp's converter writes it with --mmproj (mmproj.py). `synth.py` builds small
random checkpoints of the same structure.
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import ConvertError
from strata.names.qwen4exp import mmproj_sidecar, mtp_sidecar

from . import mmproj as _mmproj
from .qwen4exp import ARCH, OUTTYPES, Checkpoint, Qwen4ExpConverter
from .writer import Progress, write_streamed

__all__ = ["OUTTYPES", "ConvertError", "convert", "mmproj_sidecar", "mtp_sidecar_path"]


mtp_sidecar_path = mtp_sidecar  # where the MTP block of OUT goes


def convert(hf_dir: str | os.PathLike, out: str | os.PathLike, outtype: str = "f16",
            progress: bool = True, mmproj: bool = False) -> list[Path]:
    """Convert the checkpoint in `hf_dir` to the GGUF `out` (and, when the checkpoint has an
    `mtp.*` block, its sidecar; with `mmproj`, its vision tower to mmproj-<OUT name>);
    returns the paths written."""
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype {outtype!r} is not one strata convert writes; choose one of "
                           f"{', '.join(OUTTYPES)}")
    out = Path(out)
    if out.is_dir():
        raise ConvertError(f"{out} is a directory; give the output file's path, e.g. {out / 'model.gguf'}")
    if not out.parent.is_dir():
        raise ConvertError(f"{out.parent}: no such directory for the output file")
    ckpt = Checkpoint(hf_dir)
    # planned before anything is written, so that a checkpoint without a vision tower writes nothing
    vision = _mmproj.MmprojConverter(ckpt, outtype) if mmproj else None
    conv = Qwen4ExpConverter(ckpt, outtype)
    written = []
    jobs = [(out, ARCH, conv.plan(conv.main), conv.metadata, conv.data)]
    if conv.mtp:
        jobs.append((mtp_sidecar_path(out), ARCH, conv.plan(conv.mtp), conv.mtp_metadata, conv.data))
    if vision is not None:
        jobs.append((mmproj_sidecar(out), _mmproj.ARCH, vision.tensors, vision.metadata, vision.data))
    for path, arch, tensors, metadata, data in jobs:
        bar = Progress(path.name, len(tensors), sum(t.nbytes for t in tensors), enabled=progress)
        infos = [(t.name, t.shape, t.fmt) for t in tensors]
        written.append(write_streamed(path, arch, metadata(), infos, lambda i, ts=tensors, d=data: d(ts[i]), bar))
    return written
