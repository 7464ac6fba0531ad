"""The PLE table as the model gathers from it: the table's blocks in memory
(`InMemoryTable`), or a storage tier of strata.storage.ple (`StoredTable`: ram, mmap
with hints, or direct reads). Both dequantize the rows with the op that the model's
kernels name (triton_kernels.ple.ple_gather or its torch twin).

On a GPU, `ram` is read by the gather kernel itself: the table's RAM is page-locked where
it lies (cudaHostRegister, no copy) and the kernel reads the rows a step needs over PCIe,
from ids it computed on the device, so the step asks the host nothing. `mmap` and
`direct` stay host-driven: a step's rows are announced before layer 0 (`prefetch`) and
read while the layers before the PLE block compute."""
from __future__ import annotations

import warnings

import torch

from strata.tensors import host_tensor
from triton_kernels.backend import choose_kernels, to_device
from triton_kernels.host_memory import lock
from triton_kernels.ops import impl


class InMemoryTable:
    """The PLE table held as the file's blocks (zero-copy on the CPU, copied to a GPU; with
    `host`, on a GPU with the Triton kernels, left in host memory, page-locked where it lies,
    and read by the gather kernel over PCIe): rows gathered and dequantized by
    triton_kernels.ple.ple_gather."""

    def __init__(self, t, device="cpu", kernels: str | None = None, host: bool = False):
        self.name, self.fmt, self.rows = t.name, t.fmt, t.shape[0]
        self.device, self.row_bytes = torch.device(device), t.data.shape[-1]
        self._counts = {"rows": 0}  # a dict: a graph's replays add what its capture counted
        kernels = choose_kernels(kernels, device)
        with warnings.catch_warnings():  # a read-only mapping: torch warns, and nothing writes it
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(t.data)
        self.host = host and self.device.type == "cuda" and kernels == "triton"
        if self.host and not lock(t.data, read_only=not t.data.flags.writeable):
            # the placement kept the table off the GPU: copying it there is no fallback
            raise ValueError(f"PLE table {t.name!r} ({t.nbytes / 2**30:.1f} GiB): CUDA would not page-lock "
                             f"its memory for the GPU to read (cudaHostRegister refused); read it from the "
                             f"file instead: --ple-io mmap or --ple-io direct")
        self.q = blocks if self.host else to_device(blocks, device)
        self.where = (f"in memory ({t.nbytes / 2**20:.0f} MiB {t.fmt.name} "
                      + ("in host memory, read by the GPU over PCIe)" if self.host else f"on {self.device})"))
        self._gather = impl("ple_gather", kernels)

    def prefetch(self, ids: torch.Tensor) -> None:
        pass

    def gather(self, ids: torch.Tensor, bound: int | None = None) -> torch.Tensor:
        """Rows of `ids`; `bound`: the ids lie below it by construction (ple_gather's)."""
        self._counts["rows"] += ids.numel()  # a shape: read on the host without asking the device
        return self._gather(self.q, ids if self.host else ids.to(self.q.device), self.fmt, bound=bound)

    def stats(self) -> dict:
        """Rows gathered, and bytes of them read over PCIe (a table in host memory, on a GPU)."""
        rows = self._counts["rows"]
        return {"rows": rows, "pcie_bytes": rows * self.row_bytes if self.host else 0}


class StoredTable:
    """The PLE table through strata.storage.ple (ram, mmap with hints, or direct reads):
    rows announced at the start of a step (`prefetch`), read and dequantized at the PLE
    layer (`gather`)."""

    def __init__(self, table, device="cpu", kernels: str | None = None):
        self.table, self.device = table, device
        kernels = choose_kernels(kernels, device)
        self._gather = impl("ple_gather", kernels)
        # on a GPU, a table in RAM that the kernel can read where it lies
        self.host = None
        if table.mode == "ram" and torch.device(device).type == "cuda" and kernels == "triton":
            rows = table.rows_array()
            if lock(rows):
                self.host = host_tensor(rows)
        # the dequant scale (an FP8 table's) on the device once: ple_gather would otherwise
        # copy a Python float there at every step, a blocking copy no graph can hold
        self.scale = table.scale
        if self.host is not None and table.scale is not None:
            self.scale = to_device(torch.tensor([table.scale], dtype=torch.float32), device)
        self.where = (f"{table.mode}{' (locked)' if getattr(table, 'locked', False) else ''} "
                      f"from {table.source.describe()}"
                      f"{', read by the GPU over PCIe' if self.host is not None else ''}")

    def prefetch(self, ids: torch.Tensor) -> None:
        if self.host is None:
            self.table.prefetch(ids.cpu().numpy())

    def gather(self, ids: torch.Tensor, bound: int | None = None) -> torch.Tensor:
        """Rows of `ids`; `bound`: the ids lie below it by construction (ple_gather's)."""
        if self.host is not None:  # no host read: the kernel reads the rows from RAM
            self.table.count_rows(ids.numel())
            return self._gather(self.host, ids, self.table.fmt, scale=self.scale, bound=bound)
        rows = self.table.gather(ids.cpu().numpy())
        return self._gather(**rows.kernel_inputs(self.device))

    def stats(self) -> dict:
        return self.table.stats()
