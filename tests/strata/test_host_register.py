"""Host memory that a GPU's kernels read where it lies (triton_kernels.backend.register_host),
checked without a GPU through a stand-in for torch's CUDA runtime binding: a file mapped
read-only is registered with cudaHostRegisterReadOnly, a refusal clears the runtime's error
(torch checks it after every launch), and a PLE table the placement keeps in host memory is
never copied to the GPU instead when CUDA refuses it: the error names the table and the
flags that read it from the file."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import quant
from strata.storage import ple_gather
from triton_kernels import backend


class _Runtime:
    def __init__(self, err: int):
        self.err, self.calls = err, []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA runtime's name
        self.calls.append((ptr, size, flags))
        return self.err


@pytest.mark.parametrize("err", [0, 1])
@pytest.mark.parametrize("read_only", [False, True])
def test_register_host_flags_and_a_refusal_cleared(monkeypatch, err, read_only):
    runtime, cleared = _Runtime(err), []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(backend, "_clear_cuda_error", lambda: cleared.append(1))
    t = torch.zeros(1024, dtype=torch.uint8)
    assert backend.register_host(t, read_only=read_only) is (err == 0)
    assert runtime.calls == [(t.data_ptr(), 1024, backend.HOST_REGISTER_READ_ONLY if read_only else 0)]
    assert cleared == ([1] if err else [])


class _Table:
    """A GGUF tensor as GGUFFile gives it: its blocks a read-only mapping."""
    name, fmt, shape = "per_layer_token_embd.weight", quant.get("Q8_0"), (64, 32)

    def __init__(self):
        self.data = np.zeros((64, 34), dtype=np.uint8)
        self.data.flags.writeable = False
        self.nbytes = self.data.nbytes


def test_a_ple_table_kept_in_host_memory_is_registered_read_only_or_refused(monkeypatch):
    seen = []

    def refuse(t, read_only=False):
        seen.append(read_only)
        return False
    monkeypatch.setattr(ple_gather, "register_host", refuse)
    monkeypatch.setattr(ple_gather, "to_device", lambda *a, **k: pytest.fail("the table was copied to the GPU"))
    with pytest.raises(ValueError, match=r"PLE table 'per_layer_token_embd\.weight'.*cudaHostRegister refused"
                                         r".*--ple-io mmap or --ple-io direct"):
        ple_gather.InMemoryTable(_Table(), device="cuda", kernels="triton", host=True)
    assert seen == [True]
