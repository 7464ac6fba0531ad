"""Host memory that a GPU's kernels read where it lies (triton_kernels.host_memory),
checked without a GPU through a stand-in for torch's CUDA runtime binding: a file mapped
read-only is registered with cudaHostRegisterReadOnly, a refusal clears the runtime's error
(torch checks it after every launch); a range is registered once however many arrays share
it and unregistered when the last of them goes (after the GPU's queue, never inside a
graph's capture), so that memory freed and allocated again registers again; weights copied for the GPU take pages of their own size, not torch's
power-of-two blocks, and experts read from the file are locked where they were read; a
PLE table the placement keeps in host memory is never copied to the GPU instead when CUDA
refuses it: the error names the table and the flags that read it from the file."""
from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest
import torch

import quant
from strata.storage import ple_gather
from strata.storage.expert_sources import read_host
from triton_kernels import host_memory


class _Runtime:
    """torch.cuda.cudart() as far as host_memory uses it; `refuse`: the error code that
    cudaHostRegister returns (0: it registers)."""

    def __init__(self, refuse: int = 0):
        self.refuse, self.calls, self.registered = refuse, [], {}

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA runtime's names
        self.calls.append(("register", ptr, size, flags))
        if not self.refuse:
            assert not any(s < ptr + size and ptr < s + n for s, n in self.registered.items()), \
                "pages registered twice (CUDA refuses: cudaErrorHostMemoryAlreadyRegistered)"
            self.registered[ptr] = size
        return self.refuse

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        assert self.registered.pop(ptr, None) is not None, "unregistered pages never registered"
        return 0


@pytest.fixture
def runtime(monkeypatch):
    rt = _Runtime()
    monkeypatch.setattr(host_memory, "_cudart", lambda: rt)
    monkeypatch.setattr(host_memory, "_locked", {})
    yield rt
    gc.collect()


@pytest.mark.parametrize("err", [0, 1])
@pytest.mark.parametrize("read_only", [False, True])
def test_lock_flags_and_a_refusal_cleared(monkeypatch, err, read_only):
    rt, cleared = _Runtime(err), []
    monkeypatch.setattr(host_memory, "_cudart", lambda: rt)
    monkeypatch.setattr(host_memory, "_locked", {})
    monkeypatch.setattr(host_memory, "_clear_cuda_error", lambda: cleared.append(1))
    a = np.zeros(1024, dtype=np.uint8)
    assert host_memory.lock(a, read_only=read_only) is (err == 0)
    assert rt.calls == [("register", a.ctypes.data, 1024, host_memory.REGISTER_READ_ONLY if read_only else 0)]
    assert cleared == ([1] if err else [])
    assert host_memory._locked == ({} if err else {a.ctypes.data: [1024, 1]})


def test_a_range_is_registered_once_and_unregistered_when_its_last_array_goes(runtime):
    a = np.zeros(3 * mmap.PAGESIZE, dtype=np.uint8)
    ptr = a.ctypes.data
    view = a[mmap.PAGESIZE:]
    assert host_memory.lock(a) and host_memory.lock(view) and host_memory.lock(a)
    assert runtime.calls == [("register", ptr, a.nbytes, 0)]  # the view and the second lock: no call
    t = torch.from_numpy(view)  # a tensor the kernels read keeps the memory, and so the lock
    del a, view
    gc.collect()
    assert runtime.registered == {ptr: 3 * mmap.PAGESIZE}
    del t
    gc.collect()
    assert runtime.calls[1:] == [("unregister", ptr)] and runtime.registered == {} and host_memory._locked == {}
    # memory freed and given out again registers again (left registered, CUDA would refuse it)
    b = np.zeros(3 * mmap.PAGESIZE, dtype=np.uint8)
    assert host_memory.lock(b)
    assert runtime.calls[-1] == ("register", b.ctypes.data, b.nbytes, 0)


def test_a_range_whose_arrays_go_during_a_capture_is_unregistered_after_it(runtime, monkeypatch):
    """Unregistering waits for the GPU's queue first (a kernel may still read the pages), and
    a wait would end a CUDA graph's capture: a range released then is unregistered at the
    next lock or release, before any memory is registered."""
    capturing, waits = [True], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: waits.append(len(runtime.calls)))
    a = np.zeros(2 * mmap.PAGESIZE, dtype=np.uint8)
    ptr = a.ctypes.data
    assert host_memory.lock(a)
    del a
    gc.collect()
    assert runtime.calls == [("register", ptr, 2 * mmap.PAGESIZE, 0)] and waits == []
    capturing[0] = False
    b = np.ones(5 * mmap.PAGESIZE, dtype=np.uint8)
    assert host_memory.lock(b)
    assert runtime.calls[1:] == [("unregister", ptr), ("register", b.ctypes.data, b.nbytes, 0)]
    assert waits == [1]  # the queue waited for before the unregistering
    del b
    gc.collect()
    assert runtime.calls[-1][0] == "unregister" and waits == [1, 3]


def test_pinned_copies_into_pages_of_its_own_size(runtime):
    t = torch.randn(3, 5000)  # 60,000 bytes: torch's pinned blocks would round to 65,536
    p = host_memory.pinned(t)
    assert torch.equal(p, t) and p.dtype == t.dtype and p.data_ptr() != t.data_ptr()
    assert p.data_ptr() % mmap.PAGESIZE == 0
    assert runtime.calls == [("register", p.data_ptr(), 60_000, 0)]
    ptr = p.data_ptr()
    del p
    gc.collect()
    assert runtime.calls[-1] == ("unregister", ptr)


def test_experts_read_for_the_gpu_lock_the_pages_read_from_the_file(runtime, flash_tiny_gguf):
    ts = tuple(flash_tiny_gguf.tensor(f"blk.0.{n}.weight") for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    host = read_host(ts, pin=True)
    want = [("register", h.data_ptr(), t.nbytes, 0) for h, t in zip(host, ts)]
    assert runtime.calls == want  # no copy: each tensor's blocks locked where they were read
    for h, t in zip(host, ts):
        assert np.array_equal(h.reshape(-1).numpy(), np.asarray(t.data).reshape(-1))
    del host, h  # (the loop leaves its last tensor in h)
    gc.collect()
    assert runtime.registered == {}


class _Table:
    """A GGUF tensor as GGUFFile gives it: its blocks a read-only mapping."""
    name, fmt, shape = "per_layer_token_embd.weight", quant.get("Q8_0"), (64, 32)

    def __init__(self):
        self.data = np.zeros((64, 34), dtype=np.uint8)
        self.data.flags.writeable = False
        self.nbytes = self.data.nbytes


def test_a_ple_table_kept_in_host_memory_is_registered_read_only_or_refused(monkeypatch):
    seen = []

    def refuse(a, read_only=False):
        seen.append(read_only)
        return False
    monkeypatch.setattr(ple_gather, "lock", refuse)
    monkeypatch.setattr(ple_gather, "to_device", lambda *a, **k: pytest.fail("the table was copied to the GPU"))
    with pytest.raises(ValueError, match=r"PLE table 'per_layer_token_embd\.weight'.*cudaHostRegister refused"
                                         r".*--ple-io mmap or --ple-io direct"):
        ple_gather.InMemoryTable(_Table(), device="cuda", kernels="triton", host=True)
    assert seen == [True]
