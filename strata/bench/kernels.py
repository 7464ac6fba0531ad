"""`strata bench kernels`: what every weight-streaming kernel costs, statically and measured.

--static (no GPU needed): every op x format compiled for each --target at the engine's
configuration (triton_kernels.analysis.static): registers, spills, shared memory, main-loop and
whole-kernel instructions per weight, the main loop's global loads (bytes a lane per load,
the share of bytes in loads of 8 bytes or more, loads in flight before the first use), the
matrix instructions (HGMMA, HMMA, MFMA or none), and the predicted fraction of bandwidth on
named GPUs. On CUDA without --static: the decode GEMV of a 4096 x 14336 weight per format,
checked against the torch path and timed replayed from a CUDA graph (the kernels' time:
int8 activations, then the GEMV) and as launched from Python, as GB/s of weight bytes
read (graph time) against the device-to-device copy measured in the same run, the static
prediction beside it; then the MoE decode at Qwen3.8-Flash-Next's shape (one token, top
10 of 512 experts, gate and up 2560 -> 640 in IQ3_XXS, down 640 -> 2560 in IQ4_NL, as
llama.cpp's IQ3_XXS mix) as GB/s of the routed experts' bytes; the same with every
expert missed and read over PCIe from pinned host memory, staged into VRAM first (the
expert cache's path) and read by the MoE kernels directly, against the pinned
host-to-device copy; a GEMV of 512 x 2560 with K split as the engine chooses against one
program a tile; then the prefill GEMM (512 rows over the same weight) against torch's bf16
matmul of the dequantized weight, both graph-timed in the same run; a DeltaNet layer's
decode token at Flash-Next's heads, one launch against the three it replaced (with fla-core's
recurrence too where installed: strata.bench.deltanet); a decode graph's choice of QSA blocks,
one launch against the stable sort it replaced (strata.bench.qsa). Weights are held as
the engine holds them there (triton_kernels.layout; STRATA_LAYOUT=gguf for GGUF order).

--tune (CUDA): times candidate GEMV tiles per format at three heights N (graph time), and
the MoE decode's tiles, and writes the fastest into triton_kernels/configs/<device>.json.
--ncu (CUDA, Nsight Compute on PATH): the same kernels' DRAM bytes, GB/s, share of the
DRAM peak and sectors per load request, read from the hardware counters
(strata.bench.ncu).
"""
from __future__ import annotations

import sys

import numpy as np
import torch

import quant
from strata.bench import TABLE_FORMATS, cold, deltanet, qsa
from strata.bench.dequant import random_blocks
from strata.bench.report import copy_bandwidth, emit, machine, markdown
from triton_kernels import configs, layout
from triton_kernels.analysis import static
from triton_kernels.decode import unit

GEMV_SHAPE = (4096, 14336)  # (N, K): a Llama-3-8B ffn_down
# Flash-Next's routed experts: (experts, top k, hidden, intermediate, gate/up and down formats)
MOE_SHAPE = (512, 10, 2560, 640, "IQ3_XXS", "IQ4_NL")
GEMM_M = 512  # prefill rows: the GEMM of GEMV_SHAPE against torch's bf16 matmul
# (N, K) of a GEMV whose tiles leave an H200's multiprocessors idle (Flash-Next's k and v
# projections, its router): split K against one program a tile
SMALL_SHAPE = (512, 2560)
TUNE_TILES = [(bn, bu) for bn in (1, 2, 4, 8, 16) for bu in (4, 8, 16, 32, 64) if bn * bu >= 32]
# --tune's GEMV shape (N, K) for each bound on N of configs' "by_n": Flash-Next's k and v
# projections and router, GEMV_SHAPE, a vocabulary head
TUNE_SHAPES = {1024: SMALL_SHAPE, 8192: GEMV_SHAPE, 1 << 20: (65536, 2560)}
# the MoE decode's (BLOCK_N, BLOCK_K), one pair for gate/up and down (moe's tiles=)
MOE_TUNE_TILES = [(bn, bk) for bn in (16, 32, 64) for bk in (256, 512, 1024)]


def _formats(arg: str | None) -> list[str]:
    if arg is None:
        return list(TABLE_FORMATS)
    if arg == "all":
        return [f.name for f in quant.FORMATS.values()]
    return [quant.get(f.strip()).name for f in arg.split(",")]


def run(args) -> int:
    formats = _formats(args.formats)
    if args.static:
        return _run_static(args, formats)
    if not torch.cuda.is_available():
        raise ValueError("bench kernels: no CUDA device here; add --static to read the kernels' "
                         "machine code without one")
    if args.tune:
        return _run_tune(args, formats)
    if args.ncu:
        return _run_ncu(args, formats)
    return _run_measured(args, formats)


def _run_static(args, formats) -> int:
    targets = [t.strip() for t in args.target.split(",")]
    ops = [o.strip() for o in args.ops.split(",")]
    for t in targets:
        if t not in static.TARGETS:
            raise ValueError(f"bench kernels: unknown target {t!r}; targets: {', '.join(static.TARGETS)}")
    for o in ops:
        if o not in static.OPS:
            raise ValueError(f"bench kernels: unknown op {o!r}; ops: {', '.join(static.OPS)}")
    rows = [r.as_dict() for r in static.rows(ops, formats, targets)]
    for r in rows:
        r["toolchain"] = static.toolchain(r["target"])
    if args.json:
        emit(rows, "", True)
        return 0
    for t in targets:
        sel = [r for r in rows if r["target"] == t]
        gpus = [g.name for g in static.gpus_for(t)]
        for r in sel:
            for g in gpus:
                r[f"bw_{g}"] = r["pred_bw"].get(g)
            top = sorted(r["mix"].items(), key=lambda kv: -kv[1])[:4]
            r["top"] = " ".join(f"{k}:{v}" for k, v in top)
        cols = [("op", "op"), ("format", "format"), ("layout", "layout"), ("kernel", "kernel"), ("regs", "regs"),
                ("spill_bytes", "spill B"), ("instr_per_weight", "instr/w loop"),
                ("instr_per_weight_whole", "instr/w 4096x14336"), ("bytes_per_load", "B/load"),
                ("wide_load_share", ">=8B share"), ("loads_in_flight", "in flight"), ("mma", "mma")]
        cols += [(f"bw_{g}", f"{g} bw") for g in gpus] + [("top", "loop mix")]
        print(f"## {t}\n\n{static.toolchain(t)}\n")
        print(markdown(sel, cols))
        print()
    return 0


def gemv_case(fmt: quant.Format, rng: np.random.Generator, device="cuda", shape=GEMV_SHAPE):
    """(q, x, held format) on the GPU for one GEMV of `shape` (N, K): random blocks of `fmt`
    in the layout the engine holds them in there, and a bf16 row."""
    N, K = shape
    raw = torch.from_numpy(random_blocks(fmt, N * K // fmt.block_elems, rng).reshape(N, -1))
    held = layout.choose(fmt, device, N * K // fmt.block_elems)
    x = torch.from_numpy(rng.uniform(-1, 1, (1, K)).astype(np.float32)).to(device, torch.bfloat16)
    return layout.place(raw, fmt, device, held), x, held


def moe_case(rng: np.random.Generator, shape=MOE_SHAPE, device="cuda"):
    """One decode token's MoE at `shape` (MOE_SHAPE): (moe's arguments, the routed experts'
    bytes), the experts random blocks in the layout the engine holds them in on `device`."""
    E, k, H, I, f_gu, f_d = shape
    fmts, ws = [], []
    for f, rows, cols in ((f_gu, I, H), (f_gu, I, H), (f_d, H, I)):
        fmt = quant.get(f)
        blocks = E * rows * cols // fmt.block_elems
        raw = torch.from_numpy(random_blocks(fmt, blocks, rng).reshape(E, rows, -1))
        held = layout.choose(fmt, device, blocks, slab_blocks=blocks // E)
        ws.append(layout.place(raw, fmt, device, held))
        fmts.append(held)
    x = torch.from_numpy(rng.uniform(-1, 1, (1, H)).astype(np.float32)).to(device, torch.bfloat16)
    ids = torch.from_numpy(rng.permutation(E)[:k].astype(np.int32)).reshape(1, k).to(device)
    weights = torch.full((1, k), 1.0 / k, device=device)
    routed = k * sum(w[0].numel() for w in ws)
    return (x, *ws, *fmts, weights, ids), routed


def _expert_sets(case, rng) -> list[tuple[torch.Tensor]]:
    """Routings of `case`'s MoE for graph-timed calls to take in turn (cold.expert_sets:
    disjoint experts, their bytes past the L2), each a (ids,) tuple."""
    args, routed = case
    E, k = args[1].shape[0], args[-1].shape[1]
    return [(ids,) for ids in cold.expert_sets(E, k, routed, cold.l2_bytes(), rng)]


def _moe_row(case, copy: float, rng) -> dict:
    """The MoE decode of `case` (moe_case's), checked against moe_torch and graph-timed
    over routings whose experts the L2 does not hold."""
    import triton

    from triton_kernels import moe, moe_torch
    args, routed = case
    y = moe(*args, path="dp4a").float()
    ref = moe_torch(*args).float()
    rel = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    ms_graph = cold.graph_ms(lambda ids: moe(*args[:-1], ids, path="dp4a"), _expert_sets(case, rng))
    ms = triton.testing.do_bench(lambda: moe(*args, path="dp4a"), quantiles=[0.5, 0.2, 0.8])[0]
    gbps = routed / (ms_graph * 1e-3) / 1e9
    E, k, H, I, f_gu, f_d = MOE_SHAPE
    return {"op": f"moe top-{k} of {E}", "format": f"{f_gu}/{f_d}", "layout": args[4].layout,
            "N": H, "K": I, "us": ms_graph * 1e3, "us_launched": ms * 1e3, "gb_per_s": gbps,
            "pct_copy": 100 * gbps / copy, "max_rel_err": rel}


def _miss_rows(case, rng) -> list[dict]:
    """The MoE decode at MOE_SHAPE with every routed expert missed, the experts in pinned host
    memory, read over PCIe two ways: staged (stage_rows copies the k experts' rows into
    VRAM, then the MoE reads them there: the expert cache's path) and direct (the MoE
    kernels read host memory themselves). Graph-timed in one run over routings of disjoint
    experts (the GPU's L2 may keep host memory's lines too), as GB/s of the routed bytes
    against the pinned host-to-device copy; both checked against the resident call."""
    from strata.bench.decode_cost import h2d_bandwidth
    from triton_kernels import moe
    from triton_kernels.stage import stage_rows
    args, routed = case
    x, wg, wu, wd, fg, fu, fd, weights, ids = args
    E, k = wg.shape[0], ids.shape[1]
    host = [w.cpu().pin_memory() for w in (wg, wu, wd)]
    staged = [torch.empty((k, *w.shape[1:]), dtype=w.dtype, device="cuda") for w in (wg, wu, wd)]
    local = torch.arange(k, device="cuda", dtype=ids.dtype).reshape(1, k)
    missed = torch.full((k,), -1, dtype=torch.int64, device="cuda")

    def stage_then_moe(ids):
        stage_rows([h.view(E, -1) for h in host], [t.view(k, -1) for t in staged], ids.reshape(-1), missed, 0)
        return moe(x, *staged, fg, fu, fd, weights, local, path="dp4a")

    def direct(ids):
        return moe(x, *host, fg, fu, fd, weights, ids, path="dp4a")
    resident = moe(*args, path="dp4a")
    h2d = h2d_bandwidth("cuda") / 1e9
    sets = _expert_sets(case, rng)
    rows = []
    for how, fn in (("staged", stage_then_moe), ("direct", direct)):
        same = bool(torch.equal(fn(ids), resident))
        ms = cold.graph_ms(fn, sets)
        gbps = routed / (ms * 1e-3) / 1e9
        rows.append({"op": f"moe {k} misses, {how}", "format": f"{MOE_SHAPE[4]}/{MOE_SHAPE[5]}", "layout": fg.layout,
                     "us": ms * 1e3, "gb_per_s": gbps, "pct_h2d": 100 * gbps / h2d, "h2d_gb_per_s": h2d,
                     "bits_as_resident": same})
    return rows


def _split_row(name: str, rng, copy: float) -> dict:
    """The dp4a GEMV of SMALL_SHAPE, graph-timed from copies past the L2, with K split as
    "auto" chooses at this height (gemv_launch, the launch's own decision) and not split,
    in the same run."""
    from triton_kernels.int8 import gemv_dp4a, gemv_launch, quantize_x
    N, K = SMALL_SHAPE
    q, x, held = gemv_case(quant.get(name), rng, shape=SMALL_SHAPE)
    x8 = quantize_x(x.float())
    _, _, split, _ = gemv_launch(held, q.device, N, K)
    one = gemv_dp4a(x8, q, held, N, split=1)
    rel = float((gemv_dp4a(x8, q, held, N, split=split) - one).abs().max() / one.abs().max().clamp_min(1e-30))
    qs = [(c,) for c in cold.cycled(q, cold.l2_bytes())]
    ms = {s: cold.graph_ms(lambda qi, s=s: gemv_dp4a(x8, qi, held, N, split=s), qs) for s in {1, split}}
    gbps = q.numel() / (ms[split] * 1e-3) / 1e9
    return {"op": f"gemv split {split}", "format": name, "layout": held.layout, "N": N, "K": K,
            "us": ms[split] * 1e3, "us_unsplit": ms[1] * 1e3, "gb_per_s": gbps,
            "pct_copy": 100 * gbps / copy, "max_rel_err": rel}


def _gemm_row(name: str, rng) -> dict:
    """The prefill GEMM of GEMM_M rows over GEMV_SHAPE's weight, graph-timed, against torch's
    bf16 matmul of the same shape on the dequantized weight in the same run (which reads
    about four times the weight bytes); each from copies past the L2, as the GEMV."""
    from triton_kernels import dequantize, qmatmul
    q, _, fmt = gemv_case(quant.get(name), rng)
    N, K = GEMV_SHAPE
    x = torch.from_numpy(rng.uniform(-1, 1, (GEMM_M, K)).astype(np.float32)).to("cuda", torch.bfloat16)
    w = dequantize(q, fmt, dtype=torch.bfloat16).reshape(N, K)
    y = qmatmul(x, q, fmt, path="gemm").float()
    ref = (x.float() @ w.float().T)
    rel = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    l2 = cold.l2_bytes()
    ms = cold.graph_ms(lambda qi: qmatmul(x, qi, fmt, path="gemm"), [(c,) for c in cold.cycled(q, l2)])
    ms_ref = cold.graph_ms(lambda wi: torch.matmul(x, wi.T), [(c,) for c in cold.cycled(w, l2)])
    return {"op": f"gemm M={GEMM_M}", "format": name, "layout": fmt.layout, "N": N, "K": K,
            "us": ms * 1e3, "us_torch_bf16": ms_ref * 1e3, "x_torch_bf16": ms / ms_ref,
            "tflops": 2 * GEMM_M * N * K / (ms * 1e-3) / 1e12, "max_rel_err": rel}


def time_gemv(fmt, q, x, tiles=None, graph: bool = False) -> float:
    """Milliseconds a qmatmul call takes: as launched from Python (do_bench, which flushes
    the L2 first), or replayed from a CUDA graph (the kernels' own time, without the
    launches), each call reading one of q's copies in turn (strata.bench.cold)."""
    import triton

    from triton_kernels import qmatmul
    if graph:
        return cold.graph_ms(lambda qi: qmatmul(x, qi, fmt, tiles=tiles), [(c,) for c in cold.cycled(q, cold.l2_bytes())])
    return triton.testing.do_bench(lambda: qmatmul(x, q, fmt, tiles=tiles), quantiles=[0.5, 0.2, 0.8])[0]


def _run_measured(args, formats) -> int:
    rng = np.random.default_rng(0)
    copy = copy_bandwidth("cuda") / 1e9  # GB/s, read + write
    rows = []
    try:
        _measure(formats, rng, copy, rows)
    finally:  # what was measured is written, whatever stopped the rest
        _emit_measured(args, rows, copy)
    return 0


def _measure(formats, rng, copy: float, rows: list) -> None:
    from triton_kernels import qmatmul, qmatmul_torch
    from triton_kernels.int8 import gemv_dp4a_torch, quantize_x
    for name in formats:
        q, x, fmt = gemv_case(quant.get(name), rng)
        N, K = GEMV_SHAPE
        y = qmatmul(x, q, fmt).float()
        if unit(fmt) is not None:
            ref = gemv_dp4a_torch(quantize_x(x.float()), q, fmt, N)
        else:
            ref = qmatmul_torch(x.float(), q, fmt)
        rel = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        ms = time_gemv(fmt, q, x)
        ms_graph = time_gemv(fmt, q, x, graph=True)
        gbps = q.numel() / (ms_graph * 1e-3) / 1e9
        st = static.analyse("gemv", fmt, "sm_90")
        rows.append({"op": "gemv", "format": name, "layout": fmt.layout, "N": N, "K": K, "us": ms_graph * 1e3,
                     "us_launched": ms * 1e3,
                     "gb_per_s": gbps, "pct_copy": 100 * gbps / copy, "max_rel_err": rel,
                     "instr_per_weight": st.instr_per_weight, "pred_bw_h200": st.pred_bw.get("H200")})
        del q, x
    case = moe_case(rng)  # 512 experts of random blocks: built once, for both
    rows.append(_moe_row(case, copy, rng))
    rows += [_split_row(name, rng, copy) for name in formats if unit(quant.get(name)) is not None]
    rows += [_gemm_row(name, rng) for name in formats]
    try:  # fla-core's kernel, where installed, runs inside a graph here for the first time
        rows += deltanet.rows(rng, copy)
    except Exception as err:  # noqa: BLE001
        print(f"strata: bench kernels: the DeltaNet rows failed ({type(err).__name__}: {err}); "
              f"the other rows are above and below", file=sys.stderr)
    try:
        rows += qsa.rows(rng)
    except Exception as err:  # noqa: BLE001
        print(f"strata: bench kernels: the QSA choice rows failed ({type(err).__name__}: {err}); "
              f"the other rows are above and below", file=sys.stderr)
    # last: never yet run on a device, and a fault reading host memory can leave the CUDA
    # context unusable; a failure here must not cost the table its other rows
    try:
        rows += _miss_rows(case, rng)
    except Exception as err:  # noqa: BLE001
        print(f"strata: bench kernels: the MoE miss rows failed ({type(err).__name__}: {err}); "
              f"the other rows are above", file=sys.stderr)


def _emit_measured(args, rows: list[dict], copy: float) -> None:
    result = {"machine": machine(), "copy_gb_per_s": copy, "rows": rows}
    cols = [("op", "op"), ("format", "format"), ("layout", "layout"), ("us", "µs (graph)"), ("us_launched", "µs (launched)"),
            ("gb_per_s", "GB/s"), ("pct_copy", "% copy"),
            ("max_rel_err", "max rel err"), ("instr_per_weight", "instr/w (sm_90)"),
            ("pred_bw_h200", "predicted (H200)"), ("us_unsplit", "µs unsplit"), ("tflops", "TFLOP/s"),
            ("x_torch_bf16", "time / torch bf16"), ("pct_h2d", "% pinned copy"),
            ("bits_as_resident", "= resident"), ("bits_as_three", "= three launches"), ("bits_as_sort", "= sort")]
    h2d = next((r["h2d_gb_per_s"] for r in rows if "h2d_gb_per_s" in r), None)
    emit(result, markdown(rows, cols) + f"\n\ndevice-to-device copy: {copy:,.0f} GB/s (read + write)"
         + (f"; pinned host-to-device copy: {h2d:,.1f} GB/s" if h2d else "")
         + "; graph-timed calls read their weights from copies past the L2",
         args.json)


def _run_ncu(args, formats) -> int:
    from strata.bench import ncu
    rows = ncu.profile(formats)
    cols = [("op", "op"), ("format", "format"), ("kernel", "kernel"), ("us", "µs (ncu)"),
            ("dram_mb", "DRAM MB read"), ("dram_gb_per_s", "DRAM GB/s"), ("dram_pct_peak", "DRAM % peak"),
            ("sectors_per_request", "sectors/request")]
    emit({"machine": machine(), "metrics": list(ncu.METRICS), "rows": rows},
         markdown(rows, cols) + "\n\nNsight Compute, clocks left alone, caches flushed between passes; "
         "sectors/request of the global loads (16: 16 contiguous bytes a lane)", args.json)
    return 0


def tune_table(formats: list[str], time_gemv_tiles, time_moe_tiles=None) -> tuple[dict, list[dict]]:
    """The tuned table (triton_kernels.configs) and its rows: per format with int8 units, the
    fastest GEMV tiles of TUNE_TILES at each shape of TUNE_SHAPES, under "by_n", and the
    format's own tiles from GEMV_SHAPE's bucket (what a pick with no N takes); with
    time_moe_tiles, the MoE decode's (BLOCK_N, BLOCK_K) at MOE_SHAPE, for its two ops.
    time_gemv_tiles(format, (N, K), tiles) and time_moe_tiles(tiles) give milliseconds, with
    tiles None for those the engine picks now (the rows' "now" column); tiles whose compile
    or launch fails on the device are skipped, and counted in the row."""
    def fastest(timer, candidates):
        times, failed = {}, []
        for t in candidates:
            try:
                times[t] = timer(t)
            except Exception as err:  # noqa: BLE001 - e.g. Triton's OutOfResources for large tiles
                failed.append(f"{t}: {type(err).__name__}")
        if not times:
            raise ValueError(f"bench kernels --tune: no candidate tiles launched: {'; '.join(failed[:3])}")
        return min(times, key=times.get), times, len(failed)
    table: dict = {"gemv": {}}
    rows = []
    for f in formats:
        if unit(quant.get(f)) is None:
            continue
        entry: dict = {configs.BY_N: {}}
        for bound, shape in TUNE_SHAPES.items():
            best, times, failed = fastest(lambda t: time_gemv_tiles(f, shape, t), TUNE_TILES)
            tiles = {"block_n": best[0], "block_u": best[1]}
            entry[configs.BY_N][str(bound)] = tiles
            if shape == GEMV_SHAPE:
                entry.update(tiles)
            rows.append({"op": "gemv", "format": f, "shape": f"{shape[0]} x {shape[1]}", "tiles": str(best),
                         "us": times[best] * 1e3, "now_us": time_gemv_tiles(f, shape, None) * 1e3,
                         "failed": failed})
        table["gemv"][f] = entry
    if time_moe_tiles is not None:
        E, k, H, I, f_gu, f_d = MOE_SHAPE
        row = {"op": f"moe top-{k} of {E}", "format": f"{f_gu}/{f_d}", "shape": f"{H} x {I}"}
        try:  # the GEMV's table stands whatever the MoE's candidates do
            best, times, failed = fastest(time_moe_tiles, MOE_TUNE_TILES)
        except ValueError as err:
            rows.append({**row, "tiles": "none launched", "failed": len(MOE_TUNE_TILES)})
            print(f"strata: {err}", file=sys.stderr)
        else:
            for op, f in (("moe_gate_up", f_gu), ("moe_down", f_d)):
                table[op] = {f: {"block_n": best[0], "block_k": best[1]}}
            rows.append({**row, "tiles": str(best), "us": times[best] * 1e3, "now_us": time_moe_tiles(None) * 1e3,
                         "failed": failed})
    return table, rows


def _run_tune(args, formats) -> int:
    from triton_kernels import moe
    name = torch.cuda.get_device_name()
    rng = np.random.default_rng(0)
    cases = {}

    def time_gemv_tiles(f, shape, tiles):
        if (f, shape) not in cases:
            cases.clear()  # one weight at a time on the device
            cases[f, shape] = gemv_case(quant.get(f), rng, shape=shape)
        q, x, fmt = cases[f, shape]
        return time_gemv(fmt, q, x, tiles=tiles, graph=True)

    case = moe_case(rng)
    moe_args, sets = case[0], _expert_sets(case, rng)

    def time_moe_tiles(tiles):
        return cold.graph_ms(lambda ids: moe(*moe_args[:-1], ids, path="dp4a", tiles=tiles), sets)

    table, rows = tune_table(formats, time_gemv_tiles, time_moe_tiles)
    path = configs.write(name, table)
    emit({"device": name, "path": str(path), "table": table, "rows": rows},
         markdown(rows, [("op", "op"), ("format", "format"), ("shape", "N x K"), ("tiles", "best tiles"),
                         ("us", "µs"), ("now_us", "µs before"), ("failed", "tiles failed")])
         + f"\n\nwrote {path}", args.json)
    return 0
