"""`strata bench dequant`: dequantization throughput of every path on the same blocks.

CPU: Strata's torch path and gguf-py's numpy `dequantize`, timed on the same blocks in the
same run; the ratio column is against gguf-py. CUDA (`--device cuda`): the Triton kernel is
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


def _cpu_rows(fmt: quant.Format, raw: np.ndarray, args) -> tuple[float | None, list[dict]]:
    """The torch path and gguf-py on the same blocks: (gguf-py's seconds, rows)."""
    n_blocks = raw.shape[0]
    qt = torch.from_numpy(raw)
    t_torch = _median_s(lambda: dequantize_torch(qt, fmt), args.repeats)
    rows, t_peer = [], None
    if not args.no_peer:
        import gguf
        qtype = gguf.GGMLQuantizationType(fmt.type_id)
        t_peer = _median_s(lambda: gguf.quants.dequantize(raw, qtype), args.repeats)
        rows.append(_row(fmt, "gguf-py (numpy)", t_peer, n_blocks, vs_peer=1.0))
    rows.append(_row(fmt, "torch (cpu)", t_torch, n_blocks, vs_peer=t_peer / t_torch if t_peer else None))
    return t_peer, rows


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = [quant.get(n) for n in (args.formats or list(quant.FORMATS))]
    rng = np.random.default_rng(0)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch")
    rows, copy_gbps = [], None
    if cuda:
        copy_gbps = copy_bandwidth("cuda") / 1e9
    for fmt in formats:
        n_blocks = max(1, int(args.mib * 2**20) // fmt.block_bytes)
        t_peer, cpu_rows = _cpu_rows(fmt, random_blocks(fmt, n_blocks, rng), args)
        rows += cpu_rows
        if cuda:
            rows += _cuda_rows(fmt, args, rng, t_peer, n_blocks, copy_gbps)
    result = {"bench": "dequant", "device": args.device, "machine": machine(),
              "copy_gb_per_s": copy_gbps, "rows": rows}
    cols = [("format", "format"), ("path", "path"), ("mib", "MiB"), ("ms", "ms"),
            ("mvalues_per_s", "Mvalues/s"), ("gb_per_s", "GB/s in"), ("vs_peer", "x gguf-py")]
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
