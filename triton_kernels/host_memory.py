"""Host memory that a GPU's kernels read over PCIe: page-locked (cudaHostRegister), which
under NVIDIA's unified addressing makes the host pointer a device pointer too, so Triton
takes the CPU tensor as it is.

Two ways in:
- `lock(a)`: an array's memory locked where it lies, no copy however large (the PLE table:
  a file's read-only mapping, blocks made in memory, a table read into RAM; experts read
  from the drive into pages of their own);
- `pinned(t)`: `t` copied into fresh pages of its own size, locked. Not `t.pin_memory()`
  for weights: torch's caching host allocator rounds every block up to a power of two
  (flash-shape's 50 GiB of experts would lock 72) and keeps freed blocks locked for reuse.

A range is locked once however many arrays share it (CUDA refuses to register pages twice)
and stays locked while any of them lives; when the last of them is collected it is
unlocked, before the memory is freed (numpy calls an array's weak references before it
lets go of its memory) and after the GPU's queue (a kernel may still read it; during a
graph's capture, which a wait would end, at the next lock or release): freed memory left
registered would make a later allocation at the same address fail to register, and keep
its pages locked."""
from __future__ import annotations

import ctypes
import mmap
import weakref

import numpy as np
import torch

from . import backend

REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads the pages

# locked ranges: start address -> [bytes, arrays alive that use it]
_locked: dict[int, list[int]] = {}
_deferred: list[int] = []  # ranges to unregister whose last array went during a graph's capture


def host_readable(t: torch.Tensor) -> bool:
    """A host tensor a GPU's kernels may read over PCIe: page-locked (`pinned`, `lock`, or
    torch's `pin_memory`); any under a fake device."""
    return t.device.type == "cpu" and (backend.faking() or t.is_pinned())


def lock(a: np.ndarray, read_only: bool = False) -> bool:
    """Page-lock `a`'s memory where it lies, for the GPU to read, until the array that owns
    it is collected. `read_only`: pages the process may not write (a file mapped read-only),
    which CUDA registers only with cudaHostRegisterReadOnly. False where CUDA refuses, its
    error cleared (else the next launch's check would report it)."""
    if backend.faking() or a.nbytes == 0:
        return True
    _unregister_deferred()  # memory freed during a capture may be given out again
    ptr, n = a.ctypes.data, a.nbytes
    held = next((s for s, (size, _) in _locked.items() if s <= ptr and ptr + n <= s + size), None)
    if held is None:
        err = int(_cudart().cudaHostRegister(ptr, n, REGISTER_READ_ONLY if read_only else 0))
        if err != 0:
            _clear_cuda_error()
            return False
        held = ptr
        _locked[held] = [n, 0]
    _locked[held][1] += 1
    # at exit the process's end frees everything, CUDA's state first
    weakref.finalize(owner(a), _release, held).atexit = False
    return True


def pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into page-locked host memory of its own (as it is under a fake device).
    A few bytes (a step's indices) go through torch's caching host allocator; where CUDA
    refuses to lock pages, torch's `pin_memory()` is tried."""
    if backend.faking():
        return t
    n = t.numel() * t.element_size()
    if n < mmap.PAGESIZE:
        return t.pin_memory()
    pages = np.frombuffer(mmap.mmap(-1, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE), np.uint8, count=n)
    if not lock(pages):
        return t.pin_memory()
    out = torch.from_numpy(pages).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def owner(a: np.ndarray) -> np.ndarray:
    """The array whose collection frees (or unmaps) `a`'s memory: the last array down its
    chain of bases (numpy points a view at the owner of the memory, or at the mapping or
    buffer it wraps). A view of a file's np.memmap: that memmap."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _release(start: int) -> None:
    entry = _locked[start]
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _locked[start]
    _deferred.append(start)
    _unregister_deferred()


def _unregister_deferred() -> None:
    if not _deferred or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return  # a synchronize would end the capture: at the next lock or release
    if torch.cuda.is_available():
        # kernels still queued may read the pages (CUDA does not say that unregistering waits)
        torch.cuda.synchronize()
    for ptr in _deferred:
        if int(_cudart().cudaHostUnregister(ptr)) != 0:
            _clear_cuda_error()
    _deferred.clear()


def _cudart():
    return torch.cuda.cudart()


def _clear_cuda_error() -> None:
    """cudaGetLastError of the CUDA runtime torch loaded (torch's own binding has none): a
    refused runtime call leaves its error for the next check to find, which torch makes
    after every kernel launch."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((ln.split()[-1] for ln in maps if "libcudart" in ln), None)
        if path is not None:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass  # not Linux, or a runtime linked into torch: nothing to clear from here
