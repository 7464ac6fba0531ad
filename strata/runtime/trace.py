"""A step traced on fake CUDA tensors, on any machine: its kernel launches counted, and any
read of device data on the host refused with the line that asked.

    with fake_cuda():                                   # no GPU needed, nor any memory
        model = load_model(path, device="cuda", kernels="triton", experts="device")
        state = model.new_cache()
        t = trace(lambda: model(torch.tensor([1]), state))
    t.launches, t.triton, t.torch_ops                   # what the step would launch

Under `fake_cuda` torch's FakeTensorMode makes every CUDA tensor a fake one: a shape, a
dtype and a device, no data. The host-to-device copies of the loader and of the steps all
pass through `triton_kernels.backend.to_device` (a CPU-only torch refuses `t.to("cuda")`
before anything can intercept it), which becomes a fake allocation; launchers read the
tiles tuned for `gpu` (an H200's by default).

Under `trace` the Triton kernels are not run (they need real pointers): each launch is
counted by kernel name, and the launchers' own torch ops run on the fake tensors, so what
is counted is what the engine would launch on that GPU. A torch op on a device tensor
counts as one launch unless it launches nothing (views, metadata, allocations). A read of
device data on the host (`item`, `int`, `bool`, `tolist`, `nonzero`, `unique`,
`masked_select`, a copy to the host) raises `HostRead`: on a GPU each would wait for the
device's queue to drain, and none can be captured in a CUDA graph. So does a copy to the
device from pageable host memory (`HostWait`: CUDA makes the host wait for it too).
"""
from __future__ import annotations

import collections
import contextlib
import os
import traceback
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from triton_kernels import backend, host_memory
from triton_kernels.library import stubbed_launches

# ops that launch no kernel on a GPU (views are found by their schema)
_NO_LAUNCH = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
    "aten::new_empty_strided", "aten::detach", "aten::alias", "aten::lift_fresh",
    "aten::set_", "aten::resize_", "aten::sym_size", "aten::sym_stride", "aten::sym_numel",
    "aten::sym_storage_offset", "aten::is_pinned", "aten::_has_compatible_shallow_copy_type",
    "prim::device", "aten::size", "aten::stride", "aten::dim", "aten::is_contiguous",
}
# ops whose output the host reads, or whose size depends on the data
_HOST_READS = {
    "aten::_local_scalar_dense": "a value read on the host (item, int, bool, tolist)",
    "aten::nonzero": "nonzero (its size is the data's)",
    "aten::_unique2": "unique", "aten::unique_dim": "unique", "aten::_unique": "unique",
    "aten::unique_consecutive": "unique_consecutive",
    "aten::masked_select": "masked_select (its size is the data's)",
    "aten::bincount": "bincount (its size is the data's)",
}


class HostRead(RuntimeError):
    """A step read device data on the host."""


class HostWait(HostRead):
    """A step made the host wait for the device's queue without reading anything: a copy
    to the device from pageable host memory (on CUDA a blocking copy; it raises under
    torch.cuda.set_sync_debug_mode("error") and cannot be captured in a graph)."""


def _where() -> str:
    """The innermost line of Strata's own code on the stack (not this module's)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(here) and "site-packages" not in path \
                and not path.endswith(os.path.join("runtime", "trace.py")):
            return f"{os.path.relpath(path, here)}:{frame.lineno} ({frame.line})"
    return "outside Strata's code"


def _on_device(v) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type != "cpu"


@dataclass
class Trace:
    """What a traced step launched: Triton kernels by name, torch ops by name; and its
    copies from the host to the device (the tokens, RoPE's rows: each a copy on a GPU's
    queue, counted apart from the launches)."""
    triton: collections.Counter = field(default_factory=collections.Counter)
    torch_ops: collections.Counter = field(default_factory=collections.Counter)
    host_to_device: int = 0
    # every launch in order: (torch op, its arguments' and outputs' shapes), or (Triton kernel, its grid
    # and its number arguments): a step a graph can hold has the same list at any position
    ops: list = field(default_factory=list)

    @property
    def launches(self) -> int:
        return sum(self.triton.values()) + sum(self.torch_ops.values())

    def line(self, layers: int | None = None) -> str:
        """One line: launches in all (and a layer), Triton's and torch's."""
        per = f" ({self.launches / layers:.1f} a layer)" if layers else ""
        top = ", ".join(f"{k} {v}" for k, v in self.torch_ops.most_common(6))
        return (f"{self.launches} kernel launches{per}: {sum(self.triton.values())} Triton, "
                f"{sum(self.torch_ops.values())} torch ({top}, ...); "
                f"{self.host_to_device} copies from the host")


class _Count(TorchDispatchMode):
    def __init__(self, t: Trace):
        super().__init__()
        self.t = t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        flat = [*args, *kwargs.values()]
        flat += [x for v in flat if isinstance(v, (list, tuple)) for x in v]
        device = any(_on_device(v) for v in flat)
        if device and name in _HOST_READS:
            raise HostRead(f"{_HOST_READS[name]} of a device tensor at {_where()}")
        if device and name in ("aten::index", "aten::index_put_", "aten::index_put") and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None):
            raise HostRead(f"a boolean mask's indexing (its size is the data's) at {_where()}")
        if name in ("aten::_to_copy", "aten::copy_"):
            src, dst = (args[0], kwargs.get("device")) if name == "aten::_to_copy" else (args[1], args[0].device)
            if _on_device(src) and dst is not None and torch.device(dst).type == "cpu":
                raise HostRead(f"a copy from the device to the host at {_where()}")
            if name == "aten::copy_" and _on_device(args[0]) and isinstance(src, torch.Tensor) \
                    and src.device.type == "cpu" and not _async_pinned(src, args, kwargs):
                raise HostWait(f"a copy to the device from pageable host memory at {_where()}: "
                               f"triton_kernels.backend.to_device copies a step's few values from pinned memory")
        out = func(*args, **kwargs)
        if device or _on_device(out) or (isinstance(out, (list, tuple)) and any(map(_on_device, out))):
            if not func.is_view and name not in _NO_LAUNCH:
                self.t.torch_ops[name.split("::")[-1]] += 1
                outs = out if isinstance(out, (list, tuple)) else [out]
                self.t.ops.append((name, tuple(tuple(o.shape) for o in [*flat, *outs] if isinstance(o, torch.Tensor))))
        return out


class _HostStaysReal(TorchDispatchMode):
    """Under fake_cuda, an op that touches no fake tensor and makes none on a device runs
    for real: the host's side of a step (positions, block counts, sampling) keeps its values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        flat += [x for v in flat if isinstance(v, (list, tuple)) for x in v]
        dev = kwargs.get("device")
        if func._schema.name in ("aten::_to_copy", "aten::to") and not isinstance(args[0], FakeTensor):
            dev = dev or next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            if dev is not None and torch.device(dev).type != "cpu":  # host to device: a fake allocation
                return backend._fake.copy(args[0].to(dtype or args[0].dtype), torch.device(dev))
        if not any(isinstance(v, FakeTensor) for v in flat) and (dev is None or torch.device(dev).type == "cpu"):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _Record(TorchDispatchMode):
    """The aten ops an indexing expression issues, on meta stand-ins."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in _HOST_READS:  # boolean-mask indexing: nonzero
            raise HostRead(f"{_HOST_READS[func._schema.name]} in an indexing of a device tensor at {_where()}")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


def _replayed(fn):
    """`fn` (a Tensor method or property of Python's own binding: indexing, `.T`) for fake
    CUDA tensors. A CPU-only torch guards those bindings with the tensor's device, which it
    cannot make for CUDA: `fn` runs on meta stand-ins, and the aten ops it issued are
    replayed on the fake tensors."""
    def run(self, *args):
        stand, back = {}, {}

        def meta(v):
            if isinstance(v, FakeTensor):
                m = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                back[id(m)] = v
                stand[id(m)] = m  # kept alive: ids stay unique
                return m
            if isinstance(v, tuple):
                return tuple(meta(x) for x in v)
            if isinstance(v, list):
                return [meta(x) for x in v]
            return v

        rec = _Record()
        with unset_fake_temporarily(), _disable_current_modes():  # counted once: when replayed
            margs = [meta(a) for a in (self, *args)]
            try:
                with rec:
                    out = fn(*margs)
            except NotImplementedError as e:  # meta's nonzero, under boolean-mask indexing
                if "nonzero" not in str(e):
                    raise
                raise HostRead(f"a boolean mask's indexing (its size is the data's) at {_where()}") from None

        def real(v):
            if isinstance(v, torch.Tensor) and id(v) in back:
                return back[id(v)]
            if isinstance(v, torch.Tensor) and v.device.type == "meta":
                raise RuntimeError("fake CUDA indexing: an intermediate the replay did not make")
            if isinstance(v, (list, tuple)):
                return type(v)(real(x) for x in v)
            if isinstance(v, torch.device) and v.type == "meta":
                return self.device
            return v

        for func, a, k, o in rec.ops:
            got = func(*real(list(a)), **{n: real(x) for n, x in k.items()})
            for m, r in zip(o if isinstance(o, (list, tuple)) else [o],
                            got if isinstance(got, (list, tuple)) else [got]):
                if isinstance(m, torch.Tensor):
                    back[id(m)] = r
                    stand[id(m)] = m
        return real(out)
    return run


def _async_pinned(src: torch.Tensor, args, kwargs) -> bool:
    """copy_(dst, src, non_blocking) from page-locked memory: queued, the host runs on (a
    CPU-only torch pins nothing, so under fake_cuda any host tensor counts as pinned)."""
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return bool(non_blocking) and host_memory.host_readable(src)


def _set_item(self, key, value):
    """Indexing assignment on a fake CUDA tensor, replayed as indexing is. One element set
    to a Python number is refused: for a CUDA tensor torch makes the number a host tensor
    and copies it over from pageable memory, a copy the host waits for (a slice's fill_
    launches a kernel instead)."""
    keys = key if isinstance(key, tuple) else (key,)
    if isinstance(value, (bool, int, float)) and len(keys) == self.dim() and all(isinstance(k, int) for k in keys):
        raise HostWait(f"one element of a device tensor set to a Python number (a blocking copy from "
                       f"pageable host memory) at {_where()}: fill_ a slice instead, t[i:i + 1].fill_(v)")
    return _SET_ITEM(self, key, value)


_SET_ITEM = _replayed(torch.Tensor.__setitem__)


def _host_read(name: str):
    """A Python binding that reads a tensor's values on the host: refused for device ones
    (these bindings do not reach a dispatch mode first)."""
    fallback = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        if self.device.type != "cpu":
            raise HostRead(f"{name.strip('_')}() of a device tensor at {_where()}")
        return fallback(self, *args, **kwargs)
    return read


_PATCHED = {**{n: _host_read(n) for n in ("__int__", "__float__", "__bool__", "__index__", "item",
                                          "tolist", "numpy", "cpu")},"__getitem__": _replayed(torch.Tensor.__getitem__),
            "__setitem__": _set_item,
            "contiguous": _replayed(torch.Tensor.contiguous), "copy_": _replayed(torch.Tensor.copy_),
            "T": property(_replayed(lambda t: t.T)), "mT": property(_replayed(lambda t: t.mT))}


class _FakeDevice:
    """triton_kernels.backend's view of the fake GPU: copies become fake allocations."""

    def __init__(self, mode: FakeTensorMode, name: str):
        self.mode, self.name = mode, name
        self.copies = 0
        self.constants = {}  # the launchers' tables on the fake device (triton_kernels.backend.constant)

    def copy(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.copies += 1
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return FakeTensor(self.mode, meta, torch.device(device.type, device.index or 0))


@contextlib.contextmanager
def fake_cuda(gpu: str = "NVIDIA H200"):
    """Fake CUDA tensors for the block's duration (see the module); `gpu`: the device whose
    tuned launch tables the launchers read."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    saved = backend._fake
    backend._fake = _FakeDevice(mode, gpu)
    for name, f in _PATCHED.items():
        setattr(FakeTensor, name, f)
    try:
        with mode, _HostStaysReal():
            yield mode
    finally:
        backend._fake = saved
        for name in _PATCHED:
            delattr(FakeTensor, name)


def trace(step) -> Trace:
    """Run `step()` (inside `fake_cuda`) counting its launches; HostRead at a host read."""
    if backend._fake is None:
        raise RuntimeError("trace() runs inside fake_cuda(): a real step would run its kernels")
    t = Trace()
    copies = backend._fake.copies
    with stubbed_launches(lambda name: t.triton.update([name]),
                          lambda name, grid, scalars: t.ops.append((name, (grid, scalars)))), _Count(t):
        step()
    t.host_to_device = backend._fake.copies - copies
    return t
