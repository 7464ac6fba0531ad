"""`QuantLinear`: y = x @ W.T with W kept quantized (or prepared for the CPU).

Where the weight goes and how it is multiplied (chosen once, at load):
- Triton kernels (`--kernels triton`, the default on a GPU): the raw blocks on the model's
  device, through the fused dequant-matmul kernel (triton_kernels.qmatmul) in the compute
  dtype (bf16 on a GPU: tensor cores for prefill, int8 dot products for decode).
- torch kernels, bfloat16 compute, Q4_0/Q4_1: repacked for torch's int4 CPU kernel
  (_weight_int4pack_mm_for_cpu): 4 bits a weight in memory, so decode reads 1/4 of what
  bf16 would (measured on 2 cores: 0.015 ms against 0.046 ms for a 1536x576 GEMV).
  Its w = (q - 8) * scale + zero takes scale = d and zero = m + 8d (Q4_1) or 0 (Q4_0).
- torch kernels on an AVX-512 CPU with compiles on (STRATA_CPU_COMPILE), a weight of
  INT8_MIN_WEIGHTS or more in an int8-code format (triton_kernels.dequant.INT8_FORMATS:
  Q8_0, IQ4_NL, IQ3_XXS, IQ3_S, the K-quants, ...): int8 codes and float32 group scales
  ("int8", triton_kernels.cpu.codes), the file's weights exactly in 1.125-1.5 bytes a weight;
  decode multiplies them in one compiled pass a row, prefill dequantizes per call into the
  compute dtype.
- torch kernels otherwise, mixed formats too: dequantized once into the compute dtype
  ("dense"), while the model's `DenseBudget` allows (default 2048 MiB, STRATA_DENSE_MIB);
  past it, dequantized per call.
On a CPU without bfloat16 dot products, a matmul of many rows (prefill) runs in float32
with the weight upcast for the call (`_dense_mm`, triton_kernels.backend.upcast).
"""
from __future__ import annotations

import os

import numpy as np
import torch

import quant
from strata.tensors import QTensor, host_tensor
from triton_kernels import invariant, layout
from triton_kernels.backend import choose_kernels, cpu_compile_mode, cpu_int8_vectors, upcast
from triton_kernels.cpu.codes import codes_matmul
from triton_kernels.cpu.compiled import Compiled
from triton_kernels.dequant import INT8_FORMATS, dequantize_torch, int8_parts
from triton_kernels.gated_gemv import product_apart
from triton_kernels.gemv_pair import takes as pair_takes
from triton_kernels.ops import impl
from triton_kernels.qmatmul import choose_path

# Smaller weights stay dense: under about a million weights torch's bfloat16 matmul
# (about 15 us a call on 2 cores) beats the codes' compiled pass, whose guard and
# thread start cost about 40 us, and their bytes hardly matter.
INT8_MIN_WEIGHTS = 1 << 20


class DenseBudget:
    """Bytes of dequantized CPU weights one model may hold."""

    def __init__(self, mib: float | None = None):
        if mib is None:
            mib = float(os.environ.get("STRATA_DENSE_MIB", "2048"))
        self.left = int(mib * 2**20)
        self.used = 0

    def take(self, nbytes: int) -> bool:
        if nbytes > self.left:
            return False
        self.left -= nbytes
        self.used += nbytes
        return True


def _int4pack(blocks: np.ndarray, fmt: quant.Format, n: int, k: int, dtype: torch.dtype):
    d, m, codes = quant.legacy.q4_fields(blocks.reshape(-1, fmt.block_bytes))
    zero = m + 8 * d if fmt.name == "Q4_1" else np.zeros_like(d)
    g = k // 32
    sz = np.stack([d.reshape(n, g), zero.reshape(n, g)], axis=-1).transpose(1, 0, 2)  # (G, N, 2)
    w = torch.from_numpy(codes.reshape(n, k).astype(np.int32))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1)
    return packed, torch.from_numpy(np.ascontiguousarray(sz)).to(dtype)


def _rows_of(p: QTensor, r: np.ndarray | None) -> np.ndarray:
    """A weight's blocks as rows, reordered by `r` where given."""
    q = p.data.reshape(p.shape[0], -1)
    return q if r is None else q[r]


def _int4_mm(x, packed, scales):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(scales.dtype), packed, 32, scales).float()


def _gemv(x, weight):
    """One row's product as its sum: (1, K) x (N, K) -> (1, N) float32."""
    return (weight.float() * x.float()).sum(-1).reshape(1, -1)


# a large dense weight's one-row product outside a compiled step (a model's head): the
# rows N symbolic, one compile for each K
_GEMV = Compiled(_gemv, "the dense one-row product", symbolic={1: 0}, recompiles=64, dynamic=False)


def _dense_mm(x, weight):
    """x @ weight.T as float32: in the weight's dtype, or in float32 where that is faster
    (triton_kernels.backend.upcast: prefill on a CPU without bfloat16 dot products). One
    row inside a compiled step (strata.runtime.cpu_step, strata.models.qwen4exp_step): the
    product written as its sum (`_gemv`), which Inductor fuses into one loop over the weight with
    float32 sums (x not rounded to the weight's dtype), 1.3-1.7x faster than the GEMV it
    calls otherwise (measured on 2 AVX2 cores, chains of ten 256 x 256 and 2048 x 256
    bfloat16 GEMVs in one graph)."""
    if x.shape[0] == 1 and torch.compiler.is_compiling():
        return _gemv(x, weight)
    if (x.shape[0] == 1 and weight.numel() >= INT8_MIN_WEIGHTS and weight.device.type == "cpu"
            and not invariant.enabled()):
        # a large weight's one row outside a compiled step (a model's head): the same loop,
        # compiled alone (2.3 ms against 3.4 for flash-tiny's 49152 x 256 bfloat16 head on 2
        # AVX2 cores); None where compiles are off or failed
        y = _GEMV(x, weight)
        if y is not None:
            return y
    if upcast(x, weight.dtype):
        return x.float() @ weight.float().T
    return (x.to(weight.dtype) @ weight.T).float()


class QuantLinear(torch.nn.Module):
    def __init__(self, weight: QTensor | list[QTensor], dtype: torch.dtype = torch.float32,
                 device="cpu", rows: list[np.ndarray | None] | None = None,
                 budget: DenseBudget | None = None, kernels: str | None = None):
        """A list of weights with the same format and input size is fused into one (their
        output rows concatenated: one matmul instead of several). `rows` reorders each
        weight's output rows (e.g. to undo a file's Q/K permutation); rows are independent
        runs of blocks, so this costs nothing in precision. `kernels`: "triton" or "torch"
        (None: the device's default, triton_kernels.backend.choose_kernels)."""
        super().__init__()
        self.kernels = kernels = choose_kernels(kernels, device)
        parts = weight if isinstance(weight, list) else [weight]
        rows = rows or [None] * len(parts)
        fmts = {p.fmt.name for p in parts}
        ins = {int(np.prod(p.shape[1:])) for p in parts}
        if len(ins) > 1:
            raise ValueError(f"cannot fuse {[p.name for p in parts]}: input sizes {sorted(ins)} differ")
        self.name = "+".join(p.name for p in parts)
        self.fmt, self.dtype = parts[0].fmt, dtype
        self.in_features = ins.pop()
        self.splits = [p.shape[0] for p in parts]
        self.out_features = sum(self.splits)
        if len(fmts) > 1:
            # mixed formats (llama-quantize's mixes do this). Dequantized, the formats no
            # longer matter: one dense matmul (a decode's 3-5 small GEMVs a layer cost 25-80 us
            # each on 2 cores); else one matmul per part, joined.
            if kernels == "torch" and self._take_dense(parts, rows, dtype, budget):
                return
            # llama-quantize leaves routers and small projections unquantized beside quantized ones:
            # each run of consecutive parts in one format is one matmul
            self.mode = "parts"
            runs: list[tuple[list, list]] = []
            for p, r in zip(parts, rows):
                if runs and runs[-1][0][0].fmt.name == p.fmt.name:
                    runs[-1][0].append(p)
                    runs[-1][1].append(r)
                else:
                    runs.append(([p], [r]))
            self.parts = torch.nn.ModuleList(
                QuantLinear(ps if len(ps) > 1 else ps[0], dtype, device, rows=rs, budget=budget, kernels=kernels)
                for ps, rs in runs)
            return
        blocks = np.concatenate([_rows_of(p, r) for p, r in zip(parts, rows)])
        if kernels == "triton":
            self.mode = "triton"
            # on a GPU in its layout (triton_kernels.layout): repacked where it lands
            self.fmt = layout.choose(self.fmt, device, blocks.size // self.fmt.block_bytes)
            self.blocks = layout.place(host_tensor(blocks), parts[0].fmt, device, self.fmt)
            self._qmatmul = impl("qmatmul", kernels)
            self._gated = impl("gated_qmatmul", kernels)
            return
        if dtype == torch.bfloat16 and self.fmt.name in ("Q4_0", "Q4_1") and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            try:
                self.packed, self.scales = _int4pack(blocks, self.fmt, self.out_features, self.in_features, dtype)
                self.mode = "int4"
                return
            except RuntimeError:  # a shape the packed kernel does not take: stay dense
                pass
        q = host_tensor(blocks)
        large = self.out_features * self.in_features >= INT8_MIN_WEIGHTS
        # uncompiled, the codes' matmul decodes the weight every call (30 ms for SmolLM2's
        # head against 5 ms as bfloat16), so codes only where every call compiles
        # (STRATA_CPU_COMPILE=1: the default compiles in the background, and a run
        # decodes eagerly until then); without AVX-512 the compiled pass is slower than
        # bfloat16 (cpu_int8_vectors): held dense then
        if (self.fmt.name in INT8_FORMATS and str(device) == "cpu" and large and cpu_compile_mode() == "on"
                and cpu_int8_vectors()):
            held = int8_parts(q, self.fmt)
            if (budget or DenseBudget()).take(sum(t.nbytes for t in held if t is not None)):
                self.mode = "int8"
                self.codes, self.scale, self.offset = held
                return
        if not self._take_dense(parts, rows, dtype, budget):
            self.mode = "stream"
            self.blocks = q

    def _take_dense(self, parts, rows, dtype, budget) -> bool:
        """Hold the weight dequantized into `dtype` ("dense"), each part in its own format,
        if the budget allows."""
        size = self.out_features * self.in_features * torch.finfo(dtype).bits // 8
        if not (budget or DenseBudget()).take(size):
            return False
        self.mode = "dense"
        ws = []
        for p, r in zip(parts, rows):
            q = host_tensor(_rows_of(p, r))
            ws.append(dequantize_torch(q, p.fmt, dtype).view(p.shape[0], self.in_features))
        self.weight = torch.cat(ws)
        return True

    def outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """self(x) as its weights' outputs, float32, in the order they were given (views):
        in "parts" mode each run's matmul's, not joined first."""
        if self.mode == "parts":
            y = self._pair(x)
            if y is not None:
                return list(y.split(self.splits, dim=-1))
            return [y for p in self.parts for y in p.outputs(x)]
        return list(self(x).float().split(self.splits, dim=-1))

    def _pair(self, x: torch.Tensor) -> torch.Tensor | None:
        """In "parts" mode, a one-token step's two runs in one launch where they are a float
        and a dp4a GEMV that triton_kernels.gemv_pair takes (a released file's F32 rows
        beside quantized ones): (1, out_features) float32, each run's bits; else None."""
        if (self.kernels != "triton" or len(self.parts) != 2 or x.dim() != 2 or x.shape[0] != 1
                or x.dtype != torch.float32 or any(p.mode != "triton" for p in self.parts)):
            return None
        parts = [(p.blocks, p.fmt, p.out_features) for p in self.parts]
        return impl("gemv_pair", "triton")(x, parts, self.dtype) if pair_takes(parts, self.in_features) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.mode == "parts":
            y = self._pair(x2)
            return y.reshape(*lead, self.out_features) if y is not None else torch.cat([p(x) for p in self.parts], dim=-1)
        pure = self.pure()
        if pure is not None:  # int4, int8 codes, dense
            f, held = pure
            return self._rows(lambda t: f(t, *held), x2).reshape(*lead, self.out_features)
        if self.mode == "triton":
            # the dp4a path rounds float32 x to int8 per 32 values itself: a bf16 copy first
            # would round it twice, and drop what the launch that wrote x quantized of it
            # (int8.attach: hc_mix)
            dp4a = x2.dtype == torch.float32 and choose_path(self.fmt, x2.shape[0]) == "dp4a"
            y = self._qmatmul(x2 if dp4a else x2.to(self.dtype), self.blocks, self.fmt)
        else:
            dtype = torch.float32 if upcast(x2, self.dtype) else self.dtype
            w = dequantize_torch(self.blocks, self.fmt, dtype).view(self.out_features, self.in_features)
            y = self._rows(lambda t: t @ w.T, x2.to(dtype))
        return y.float().reshape(*lead, self.out_features)

    def gated(self, g: torch.Tensor, u: torch.Tensor, silu: bool = True,
              product: torch.Tensor | None = None) -> torch.Tensor:
        """self(silu(g) * u), or self(sigmoid(g) * u) for silu=False, for float32 rows g, u:
        with the Triton kernels the gate in the GEMV's launch where it runs one
        (triton_kernels.gated_gemv), the two launches' result. `product`: the gate's result
        as an earlier launch wrote it, where `product_apart` says the GEMV takes one."""
        if self.mode == "triton":
            return self._gated(g, u, self.blocks, self.fmt, silu, self.dtype, product).float()
        if product is None:
            product = impl("silu_mul" if silu else "sigmoid_mul", self.kernels)(g, u)
        return self(product)

    def product_apart(self, rows: int) -> bool:
        """Whether `gated` of `rows` rows launches the gate's product apart from the GEMV
        (triton_kernels.gated_gemv.product_apart): an earlier launch may then write it."""
        return self.mode == "triton" and product_apart(self.fmt, rows)

    def pure(self):
        """(f, args) with f(x, *args) == self(x) for 2-D x, f a module-level function of
        tensors (and the dtype) alone: a compiled step traces it, and one compile serves every
        layer of the same shapes. None for the modes a compiled step does not take (mixed
        formats past the budget, per-call dequantization, Triton)."""
        if self.mode == "int4":
            return _int4_mm, (self.packed, self.scales)
        if self.mode == "int8":
            return codes_matmul, (self.codes, self.scale, self.offset, self.dtype)
        if self.mode == "dense":
            return _dense_mm, (self.weight,)
        return None

    def _rows(self, f, x):
        # batch-invariant mode (triton_kernels.invariant): calls of a fixed number of rows
        if not invariant.enabled():
            return f(x)
        return invariant.rows(f, x, key=(self.mode, self.out_features, self.in_features, self.dtype))

    def held_bytes(self) -> int:
        """Bytes this layer's weight occupies as held (packed, dense or raw blocks)."""
        if self.mode == "parts":
            return sum(p.held_bytes() for p in self.parts)
        ts = {"int4": ("packed", "scales"), "dense": ("weight",), "int8": ("codes", "scale", "offset")}.get(
            self.mode, ("blocks",))
        return sum(t.nbytes for t in (getattr(self, n) for n in ts) if t is not None)

    def extra_repr(self) -> str:
        return f"{self.name}, {self.fmt.name}, {self.in_features}->{self.out_features}, {self.mode}"
