"""`strata bench dequant`: dequantization throughput of every path on the same blocks.

CPU: Strata's torch path and a peer, timed on the same blocks in the same run; the ratio
column is against the peer, and "same bits" says whether our floats equal the peer's bit for
bit. The peer is gguf-py's numpy `dequantize` (`--peer gguf-py`, the default) or ggml's own
C `to_float` through ctypes (`--peer ggml`, strata/bench/ggml.py; needs llama-cpp-python).
The torch path writes into a float32 buffer allocated once, as ggml's to_float writes its
caller's (a fresh buffer's first-touch page faults would cost more than the dequant);
gguf-py allocates its result, as its API does. `--compile` adds the one-pass loops of
torch.compile (triton_kernels/cpu/dequant_compiled.py: Q8_0, Q4_0, IQ4_NL), with the seconds
their first call took (Inductor's compile; far less when its disk cache is warm).
`--threads 1` is the single-core comparison (ggml's to_float runs on the calling thread
only). CUDA (`--device cuda`): the Triton kernel is
first checked against the numpy reference on fresh random blocks, then timed with
`triton.testing.do_bench` on at least 1 GiB of blocks, as GB/s (quantized bytes read plus
output bytes written) against the device-to-device copy bandwidth measured in the run.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import quant
from strata.bench.report import copy_bandwidth, emit, machine, markdown
from triton_kernels import dequantize, dequantize_torch
from triton_kernels.cpu.dequant_compiled import has_fused


def random_blocks(fmt: quant.Format, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks with every byte random except the fp16 scales, which are finite, so that
    timing sees no NaN slow paths."""
    if fmt.block_elems == 1:  # the float formats: encode finite values
        return fmt.quantize(rng.standard_normal(n_blocks, dtype=np.float32)).reshape(n_blocks, -1)
    raw = rng.integers(0, 256, (n_blocks, fmt.block_bytes), dtype=np.uint8)
    for off in fmt.scale_offsets:
        d = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    if fmt.write_scale is not None:  # a scale spread over bit fields (IQ1_M)
        fmt.write_scale(raw, (rng.standard_normal(n_blocks) * 0.01).astype(np.float16))
    return raw


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, table uploads
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _row(fmt, path, seconds, n_blocks, out_bytes_per_value=None, **extra) -> dict:
    values = n_blocks * fmt.block_elems
    qbytes = n_blocks * fmt.block_bytes
    row = {"format": fmt.name, "path": path, "mib": qbytes / 2**20, "ms": seconds * 1e3,
           "mvalues_per_s": values / seconds / 1e6, "gb_per_s": qbytes / seconds / 1e9}
    if out_bytes_per_value is not None:  # device rows: bytes read + written
        row["gb_per_s_rw"] = (qbytes + values * out_bytes_per_value) / seconds / 1e9
    row.update(extra)
    return row


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in units in the last place between non-NaN float32 values."""
    ok = ~(np.isnan(a) | np.isnan(b))
    ia = a[ok].view(np.int32).astype(np.int64)
    ib = b[ok].view(np.int32).astype(np.int64)
    # map the sign-magnitude bit patterns onto a monotonic integer line
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.abs(ia - ib).max()) if ia.size else 0


def check_on_device(fmt: quant.Format, rng: np.random.Generator, n_blocks: int) -> str:
    raw = rng.integers(0, 256, (n_blocks, fmt.block_bytes), dtype=np.uint8)
    for off in fmt.scale_offsets:  # finite scales of every magnitude fp16 has
        d = rng.integers(0, 0x7C00, n_blocks).astype(np.uint16) | (rng.integers(0, 2, n_blocks) << 15).astype(np.uint16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    if fmt.write_scale is not None:
        d = rng.integers(0, 0x7C00, n_blocks).astype(np.uint16) | (rng.integers(0, 2, n_blocks) << 15).astype(np.uint16)
        fmt.write_scale(raw, d.view(np.float16))
    ref = fmt.dequantize(raw)
    got = dequantize(torch.from_numpy(raw).cuda(), fmt).cpu().numpy()
    same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
    if same.all():
        return "bit-exact"
    return f"{(~same).sum()} of {same.size} differ, max {_ulps(got, ref)} ulp"


def _same_bits(ours: np.ndarray, theirs: np.ndarray) -> str:
    """"yes" when equal bit for bit (any NaN equal to any NaN), else how many differ."""
    a, b = ours.reshape(-1).view(np.uint32), theirs.reshape(-1).view(np.uint32)
    nan = np.isnan(ours.reshape(-1)) & np.isnan(theirs.reshape(-1))
    differ = int(((a != b) & ~nan).sum())
    return "yes" if differ == 0 else f"{differ:,} differ"


def _peer(fmt: quant.Format, raw: np.ndarray, args, ggml):
    """(path name, a call that dequantizes `raw` into a float32 array) of the chosen peer, or
    None where it has no dequantizer for the format."""
    if args.no_peer:
        return None
    if ggml is not None:
        fn = ggml.to_float(fmt)
        if fn is None:
            return None
        out = np.empty(raw.shape[0] * fmt.block_elems, np.float32)
        return "ggml to_float (C)", lambda: ggml.dequantize(fn, raw, out)
    import gguf
    qtype = gguf.GGMLQuantizationType(fmt.type_id)
    return "gguf-py (numpy)", lambda: gguf.quants.dequantize(raw, qtype)


def _cpu_rows(fmt: quant.Format, raw: np.ndarray, args, ggml=None) -> tuple[float | None, list[dict]]:
    """The torch path(s) and the peer on the same blocks: (the peer's seconds, rows)."""
    n_blocks = raw.shape[0]
    qt = torch.from_numpy(raw)
    out = torch.empty((n_blocks, fmt.block_elems))
    paths = [("torch (cpu)", lambda: dequantize_torch(qt, fmt, out=out, compiled=False), None)]
    if getattr(args, "compile", False) and has_fused(fmt):
        t = time.perf_counter()
        dequantize_torch(qt[:2], fmt, compiled=True)  # the compile, on two blocks
        paths.append(("torch.compile (cpu)", lambda: dequantize_torch(qt, fmt, out=out, compiled=True),
                      time.perf_counter() - t))
    rows, t_peer, theirs = [], None, None
    peer = _peer(fmt, raw, args, ggml)
    if peer is not None:
        name, call = peer
        theirs = np.array(call(), dtype=np.float32, copy=True)
        t_peer = _median_s(call, args.repeats)
        rows.append(_row(fmt, name, t_peer, n_blocks, vs_peer=1.0))
    for name, call, compile_s in paths:
        t = _median_s(call, args.repeats)
        rows.append(_row(fmt, name, t, n_blocks, vs_peer=t_peer / t if t_peer else None, compile_s=compile_s,
                         same_bits=_same_bits(out.numpy(), theirs) if theirs is not None else None))
    return t_peer, rows


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = [quant.get(n) for n in (args.formats or list(quant.FORMATS))]
    rng = np.random.default_rng(0)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch")
    ggml = None
    if args.peer == "ggml" and not args.no_peer:
        from strata.bench.ggml import Ggml
        ggml = Ggml()
    rows, copy_gbps = [], None
    if cuda:
        copy_gbps = copy_bandwidth("cuda") / 1e9
    for fmt in formats:
        n_blocks = max(1, int(args.mib * 2**20) // fmt.block_bytes)
        t_peer, cpu_rows = _cpu_rows(fmt, random_blocks(fmt, n_blocks, rng), args, ggml)
        rows += cpu_rows
        if cuda:
            rows += _cuda_rows(fmt, args, rng, t_peer, n_blocks, copy_gbps)
    result = {"bench": "dequant", "device": args.device, "machine": machine(),
              "peer": None if args.no_peer else (ggml.version if ggml else "gguf-py"),
              "copy_gb_per_s": copy_gbps, "rows": rows}
    cols = [("format", "format"), ("path", "path"), ("mib", "MiB"), ("ms", "ms"),
            ("mvalues_per_s", "Mvalues/s"), ("gb_per_s", "GB/s in"), ("vs_peer", f"x {args.peer}")]
    if not args.no_peer:
        cols.append(("same_bits", "same bits"))
    if getattr(args, "compile", False):
        cols.append(("compile_s", "compile s"))
    if cuda:
        cols += [("gb_per_s_rw", "GB/s r+w"), ("pct_copy", "% copy"), ("check", "check")]
    table = markdown(rows, cols)
    if cuda:
        table += f"\n\ndevice-to-device copy: {copy_gbps:,.0f} GB/s (read + write, 1 GiB)"
    emit(result, table, args.json)
    return 0


def _cuda_rows(fmt, args, rng, t_peer, host_blocks, copy_gbps) -> list[dict]:
    import triton.testing
    check = check_on_device(fmt, rng, 4096)
    n_blocks = max(1, int(max(args.mib, 1024) * 2**20) // fmt.block_bytes)
    q = torch.from_numpy(random_blocks(fmt, n_blocks, rng)).cuda()
    out_bytes = 4
    peer_rate = (host_blocks / t_peer) if t_peer else None  # blocks per second
    rows = []
    for path, fn in (("triton (cuda)", lambda: dequantize(q, fmt)),
                     ("torch (cuda)", lambda: dequantize_torch(q, fmt))):
        ms = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])[0]
        s = ms * 1e-3
        row = _row(fmt, path, s, n_blocks, out_bytes, check=check if path.startswith("triton") else None,
                   vs_peer=(n_blocks / s) / peer_rate if peer_rate else None)
        row["pct_copy"] = 100 * row["gb_per_s_rw"] / copy_gbps
        rows.append(row)
        torch.cuda.empty_cache()
    return rows
