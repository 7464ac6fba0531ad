"""The Triton interpreter without its repeated patching: a third of the suite's kernel time.

A launch under TRITON_INTERPRET=1 patches triton.language (its builtins, tensor methods,
range, reduce, ...) with the interpreter's versions, runs every program, and restores them.
Every call of a @triton.jit *device* function (a format's decode, dot_units, dp4a, ...)
patches again, from scratch (`inspect.getmembers` over the module), although the launch
has already patched the same modules and the second patch changes nothing: the builtins
are wrapped already, and the rest is set to equal closures. The MoE dp4a kernels make
about 1,500 such calls a program; their patching was 30-35% of the interpreter's time.

`install()` skips a device function's patch while a launch that patched the same modules
runs; a launch itself, or a device function whose module holds another language module,
patches as before, and where the Triton release keeps a device function's patch to the
launch's end (3.9: its scope is never restored), that module counts as patched from then on
(triton.language's own @jit functions, `tl.sum`, `tl.zeros`, see tl.core: about 3,000
patches a MoE launch, now a few; 7-8% of its time). It also remembers the numpy dtype of each Triton dtype: the interpreter
builds a 16-entry dict to look one up on every tensor it makes (about 60,000 times a MoE
launch; 6-10% of the MoE dp4a kernels' time). What the kernels compute does not change (the
same wrapped functions run, the same dtypes are found); a Triton release without these
internals is left alone (the suite is then slower).

It also builds each tensor type once. Every operation of an interpreted program makes
new `tl.block_type`s and `tl.tensor`s, each validating its shape anew, and compares
types through `tl.tuple.__eq__`, which normalises both shapes recursively: 35-40% of a
dp4a MoE launch's time (one `moe(..., path="dp4a")` of 3 experts, 2 tokens: Q8_0
5.9 s -> 3.7 s of CPU, IQ3_S 22.4 -> 13.4, the same bits). A type's
shape, element count and name are kept per (element type, shape), and two types that
share the kept shape compare by their element types alone: what the full comparison
would find, since equal keys give the same shape object.

It keeps the type checks of binary operations (see _type_checks_kept): their computation
types, integer constants splatted once per shape, blocks broadcast over lists of ints. One
interpreted `moe(...)` of 3 experts and 2 tokens, without the instruction models below:
IQ4_NL (dp4a) 1.25 s -> 0.72-0.85 s of CPU, Q3_K (tl.dot) 0.93 -> 0.45-0.69, Q8_0 (dp4a)
0.175 -> 0.11-0.14, the same bits (tests/test_triton_interpreter.py holds the kept checks
to Triton's own).

And it drops the integer overflow checks that assert nothing (see
_no_overflow_checks_that_assert_nothing): the largest of these costs, about three quarters
of an interpreted MoE launch's time.

`instructions_by_their_models()` (a second step, for the suite) computes the integer
helpers of triton_kernels.asm (dp4a, pack16, prmt), whose pure-Triton twins the interpreter
runs, by numpy models of the instructions: half of what remained of an interpreted MoE
dp4a launch. tests/triton_kernels/test_asm.py holds each twin to its model (inside
`twins()`, where the twins themselves run).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading


def install() -> bool:
    """Patch the interpreter in this process; False where its internals differ."""
    try:
        import triton.language as tl
        import triton.runtime.interpreter as ti
    except ImportError:
        return False
    executor = getattr(ti, "GridExecutor", None)
    if getattr(ti, "_strata_once", False):
        return True
    if not callable(getattr(ti, "_patch_lang", None)) or executor is None or not hasattr(ti, "InterpretedFunction"):
        return False
    patch_lang, run_grid = ti._patch_lang, executor.__call__
    state = threading.local()
    langs_of: dict = {}

    class _Unpatched:
        def restore(self):
            pass

    def langs(fn) -> frozenset:
        got = langs_of.get(fn)
        if got is None:
            got = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                           if inspect.ismodule(v) and v in (tl, tl.core))
        return got

    # whether a device function's patch holds for the rest of its launch: Triton releases
    # whose device call drops the patch's scope (3.x from 3.4 on) never restore it
    try:
        kept = "restore" not in inspect.getsource(ti.InterpretedFunction.__call__)
    except (OSError, TypeError):
        kept = False

    def once_per_launch(fn):
        launch = getattr(state, "launch", None)
        if launch is not None:
            if launch[0] is None:  # the launch's own patch, restored when it ends
                launch[0] = langs(fn)
            elif langs(fn) <= launch[0]:
                return _Unpatched()
            elif kept:  # e.g. triton.language.standard's functions, which see tl.core
                launch[0] = launch[0] | langs(fn)
        return patch_lang(fn)

    def launch(self, *args, **kwargs):
        held, state.launch = getattr(state, "launch", None), [None]
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            state.launch = held

    ti._patch_lang = once_per_launch
    executor.__call__ = launch
    np_dtype = getattr(ti, "_get_np_dtype", None)
    if callable(np_dtype):
        ti._get_np_dtype = _remembered(np_dtype, tl.block_type)
    _types_built_once(tl.core)
    _type_checks_kept(ti, tl)
    _no_overflow_checks_that_assert_nothing(ti)
    ti._strata_once = True
    return True


def _type_checks_kept(ti, tl) -> None:
    """Every binary operation of an interpreted program checks its operands' types, finds
    their computation type and broadcasts them (tl.semantic's binary_op_type_checking_impl):
    three quarters of an interpreted `a + b`, and 12% of the whole suite's busy time (py-spy
    over the full suite). Here the interpreter's semantic object, for operands of plain
    element types (not pointers) and Python ints and floats:
    - keeps the computation type of each pair of element types (a pure function of their
      names, all that computation_type_impl reads; a TypeError raised is not kept);
    - keeps each integer constant as its checked, typed and splatted array (read-only, so
      that a write into one would fail, not spread), per element type and shape;
    - passes a pointer plus an integer tensor, which the checks allow (allow_lhs_ptr), to
      the broadcast at once;
    - broadcasts two blocks of one rank dimension by dimension as Triton does, but over
      lists of ints (Triton compares its own tuple type, which normalises both sides), and
      splats a scalar without building the IR type (a second block type, through the
      dtype's chain of name tests) of which the interpreter reads only the shape.
    Anything else takes Triton's own path. The values computed do not change; a release
    whose signatures differ is left alone."""
    sem, builder = getattr(ti, "interpreter_semantic", None), getattr(ti, "interpreter_builder", None)
    try:
        shapes = [list(inspect.signature(getattr(type(o), f)).parameters) for o, f in (
            (sem, "binary_op_type_checking_impl"), (sem, "broadcast_impl_value"), (builder, "create_splat"),
            (builder, "create_broadcast"))]
        tuple_shape = isinstance(tl.block_type(tl.int32, [2]).shape, tl.core.tuple)
    except (AttributeError, TypeError, ValueError):
        return
    if shapes != [["self", "lhs", "rhs", "allow_lhs_ptr", "allow_rhs_ptr", "arithmetic_check", "div_or_mod"],
                  ["self", "lhs", "rhs"], ["self", "ret_ty", "arg"], ["self", "arg", "shape"]] or not tuple_shape:
        return
    block, tensor, plain, pointer, handle = tl.block_type, tl.tensor, tl.dtype, tl.pointer_type, ti.TensorHandle
    checking, broadcast = type(sem).binary_op_type_checking_impl, type(sem).broadcast_impl_value
    computation: dict = {}
    constants: dict = {}

    def broadcast_impl_value(lhs, rhs):
        lt, rt = lhs.type, rhs.type
        if type(lt) is block:
            if type(rt) is block:
                if lt.shape is rt.shape:
                    return lhs, rhs
                left, right = lt.shape.values, rt.shape.values
                if left == right:
                    return lhs, rhs
                if len(left) == len(right):
                    out = [r if l == 1 else l if r == 1 or r == l else None for l, r in zip(left, right)]
                    if None not in out:  # else Triton's error
                        if left != out:
                            ty = block(lt.scalar, out)
                            lhs = tensor(builder.create_broadcast(lhs.handle, out), ty)
                        if right != out:
                            ty = block(rt.scalar, out)
                            rhs = tensor(builder.create_broadcast(rhs.handle, out), ty)
                        return lhs, rhs
            elif not rt.is_block():
                ty = block(rt.scalar, lt.shape)
                return lhs, tensor(builder.create_splat(ty, rhs.handle), ty)
        elif type(rt) is block and not lt.is_block():
            ty = block(lt.scalar, rt.shape)
            return tensor(builder.create_splat(ty, lhs.handle), ty), rhs
        return broadcast(sem, lhs, rhs)

    def cast(t, ty):  # Triton's cast returns its input where the element types are equal
        return t if t.dtype.name == ty.name else sem.cast(t, ty)

    def computation_type(a, a_number, b, b_number, div_or_mod):
        key = (a.name, a_number, b.name, b_number, div_or_mod)
        ty = computation.get(key)
        if ty is None:
            ty = computation[key] = sem.computation_type_impl(a, a_number, b, b_number, div_or_mod)
        return ty

    def with_number(t, v, number_first, div_or_mod):
        """(t, v) or (v, t) cast and broadcast, v a Python int or float."""
        like = t.type
        shape = tuple(like.shape.values) if type(like) is block else None
        key = (t.dtype.name, type(v), v, number_first, div_or_mod, shape)
        got = constants.get(key) if type(v) is int else None  # not floats: 0.0 == -0.0
        if got is None:
            n = sem.to_tensor_type(v)
            ty = computation_type(n, True, t.dtype, False, div_or_mod) if number_first else \
                computation_type(t.dtype, False, n, True, div_or_mod)
            c = sem._cast_to_computation_type(v, ty)  # its range checks raise here
            data, c_ty = c.handle.data, c.type
            if shape is not None:
                c_ty = block(c_ty.scalar, like.shape)
                data = builder.create_splat(c_ty, c.handle).data
            data.flags.writeable = False
            got = (ty, data, c.handle.dtype, c_ty)
            if type(v) is int:
                constants[key] = got
        ty, data, h_ty, c_ty = got
        c = tensor(handle(data, h_ty), c_ty)
        t = cast(t, ty)
        return (c, t) if number_first else (t, c)

    def binary_op_type_checking_impl(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False,
                                     arithmetic_check=True, div_or_mod=False):
        left, right = type(lhs), type(rhs)
        if left is tensor and right is tensor:
            a, b = lhs.dtype, rhs.dtype
            if type(a) is plain and type(b) is plain:
                if arithmetic_check:
                    ty = computation_type(a, False, b, False, div_or_mod)
                    lhs, rhs = cast(lhs, ty), cast(rhs, ty)
                return broadcast_impl_value(lhs, rhs)
            if allow_lhs_ptr and type(a) is pointer and type(b) is plain and b.is_int():
                return broadcast_impl_value(lhs, rhs)
        elif arithmetic_check and left is tensor and right in (int, float) and type(lhs.dtype) is plain:
            return with_number(lhs, rhs, False, div_or_mod)
        elif arithmetic_check and right is tensor and left in (int, float) and type(rhs.dtype) is plain:
            return with_number(rhs, lhs, True, div_or_mod)
        return checking(sem, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    sem.broadcast_impl_value = broadcast_impl_value
    sem.binary_op_type_checking_impl = binary_op_type_checking_impl
    kept_checks.update(broadcast_impl_value=broadcast_impl_value,
                       binary_op_type_checking_impl=binary_op_type_checking_impl)


kept_checks: dict = {}  # what _type_checks_kept set on the interpreter's semantic object


@contextlib.contextmanager
def triton_checks():
    """Inside, the interpreter checks, casts and broadcasts by Triton's own code (for
    tests/test_triton_interpreter.py, which holds the kept checks to it)."""
    import triton.runtime.interpreter as ti
    sem = ti.interpreter_semantic
    for name in kept_checks:
        delattr(sem, name)
    try:
        yield
    finally:
        for name, fn in kept_checks.items():
            setattr(sem, name, fn)


def _no_overflow_checks_that_assert_nothing(ti) -> None:
    """The interpreter's options ask for integer overflow checks (`sanitize_overflow`) but
    not for `debug`, and without `debug` Triton's device_assert returns before it looks at
    its condition: every 32-bit integer add, sub and mul was still redone in int64 and
    compared with the type's range, for nothing. Without them the MoE expert-matmul
    property of Q3_K took 15 s where it took 69 (25 examples, one core), and test_moe.py
    with test_int8.py 233 s where they took about 475 (`-n 2`), the same bits computed.
    With `debug` on (a reader debugging a kernel) the checks stay, and then assert."""
    import dataclasses
    builder = getattr(ti, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and {"debug", "sanitize_overflow"} <= {
            f.name for f in dataclasses.fields(options)} and not options.debug:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _remembered(np_dtype, block_type):
    """np_dtype with its answers kept (Triton's dtypes are hashable values; one that is not
    is looked up as before). A block type is its element type's (as np_dtype finds it)."""
    kept = functools.lru_cache(maxsize=None)(np_dtype)

    def lookup(tt_dtype):
        if type(tt_dtype) is block_type:
            tt_dtype = tt_dtype.element_ty
        try:
            return kept(tt_dtype)
        except TypeError:
            return np_dtype(tt_dtype)
    return lookup


def _types_built_once(core) -> None:
    """tl.block_type and tl.tensor built from kept shapes (see the module's docstring);
    left alone where their constructors differ from Triton 3.x's."""
    block, tensor, base = core.block_type, core.tensor, core.base_value
    if not {"element_ty", "shape"} <= set(inspect.signature(block.__init__).parameters) or \
            not {"handle", "type"} <= set(inspect.signature(tensor.__init__).parameters):
        return
    make_block, block_eq, kept_blocks, kept_shapes = block.__init__, block.__eq__, {}, {}

    def block_init(self, element_ty, shape):
        try:  # the shape's entries with their types: constexpr(4) and 4.0 stay apart
            key = (element_ty, tuple(shape), tuple(map(type, shape)))
            got = kept_blocks.get(key)
        except TypeError:
            return make_block(self, element_ty, shape)
        if got is None:
            make_block(self, element_ty, shape)
            kept_blocks[key] = (self.shape, self.numel, self.name)
        else:
            self.element_ty = element_ty
            self.shape, self.numel, self.name = got

    def same_block(self, other):
        if self is other:
            return True
        if type(other) is block and self.shape is other.shape:
            return self.element_ty == other.element_ty
        return block_eq(self, other)

    def tensor_init(self, handle, type):
        base.__init__(self)
        self.handle, self.type, self.dtype = handle, type, type.scalar
        shape = tuple(type.shape) if type.is_block() else ()
        got = kept_shapes.get(shape)
        if got is None:
            got = kept_shapes[shape] = (core.constexpr(math.prod(shape)),
                                        core.tuple([core.constexpr(s) for s in shape]))
        self.numel, self.shape = got

    block.__init__, block.__eq__, tensor.__init__ = block_init, same_block, tensor_init


# --- the integer instructions by their models ----------------------------------------------

_twins = threading.local()
modelled: dict = {}  # name -> calls computed by the model (a test checks the models are used)


@contextlib.contextmanager
def twins(on: bool = True):
    """Inside, triton_kernels.asm's helpers run their pure-Triton twins, as without
    instructions_by_their_models (tests/triton_kernels/test_asm.py checks the twins so);
    `on=False`: by the models again."""
    held, _twins.on = getattr(_twins, "on", False), on
    try:
        yield
    finally:
        _twins.on = held


def instructions_by_their_models() -> bool:
    """Under the interpreter, triton_kernels.asm's dp4a, pack16 and prmt with ASM="" (the
    twins, what the interpreter runs) compute by the instructions' numpy models
    (tests/instruction_models.py) in one step each, where the twin took 5 to 40 interpreted
    operations: dp4a's twin, 24 of them and 8 device calls, ran 8 times a 32-weight unit in
    the int8 kernels (half the time of an interpreted MoE dp4a launch: IQ4_NL 1.05 s ->
    0.61 s, Q8_0 0.17 -> 0.08, the same bits). test_asm.py holds each twin to its model
    bit for bit on every byte pair and selector (inside `twins()`), so a kernel computes
    the same integers either way. A call the models do not cover (another dtype than the
    instruction's, a scalar, a selector nibble with bit 3 set) runs the twin.
    False where the interpreter keeps no table of rewritten functions."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as ti
    from tests import instruction_models as m
    from triton_kernels import asm

    table = getattr(getattr(ti, "InterpretedFunction", None), "rewritten_fn", None)
    helpers = (asm.dp4a, asm.pack16, asm.prmt)
    if not isinstance(table, dict) or not all(isinstance(h, ti.InterpretedFunction) for h in helpers):
        return False
    if modelled:
        return True  # installed already

    def prmt(a, b, sel):
        if (m.prmt_selects(sel) & 8).any():
            return None  # bit 3 set: the instruction would replicate a sign, the twin ignores it
        return m.prmt_model(a, b, sel)

    for helper, model, kinds in ((asm.dp4a, m.dp4a_model, (tl.int32, tl.int32, tl.int32)),
                                 (asm.pack16, m.pack16_model, (tl.uint16, tl.uint16)),
                                 (asm.prmt, prmt, (tl.int32, tl.int32, (tl.int32, int)))):
        table[helper.fn] = _by_model(helper.fn.__name__, helper.rewrite(), model, kinds)
    return True


def _by_model(name, twin, model, kinds):
    """twin(*values, ASM) computed as model(*arrays) where the model covers the call."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as ti
    modelled.setdefault(name, 0)

    def call(*args, **kwargs):
        if kwargs or len(args) != len(kinds) + 1 or getattr(_twins, "on", False):
            return twin(*args, **kwargs)
        *values, asm = args
        if (asm.value if isinstance(asm, tl.constexpr) else asm) != "":
            return twin(*args)
        arrays = []
        for v, kind in zip(values, kinds):
            if isinstance(v, tl.constexpr):
                v = v.value
            if isinstance(v, tl.tensor):
                if not v.type.is_block() or v.dtype not in (kind if isinstance(kind, tuple) else (kind,)) or \
                        v.handle.data.shape != tuple(v.type.shape):
                    return twin(*args)
                arrays.append(v.handle.data)
            elif type(v) is int and isinstance(kind, tuple) and int in kind and -2 ** 31 <= v < 2 ** 31:
                arrays.append(np.int64(v))
            else:
                return twin(*args)
        if len({a.ndim for a in arrays if a.ndim}) != 1:  # no block, or blocks of other ranks
            return twin(*args)
        try:
            shape = np.broadcast_shapes(*(a.shape for a in arrays))
        except ValueError:
            return twin(*args)
        out = model(*(np.broadcast_to(a, shape) for a in arrays))
        if out is None:
            return twin(*args)
        modelled[name] += 1
        return tl.tensor(ti.TensorHandle(np.ascontiguousarray(out, np.int32), tl.int32), tl.block_type(tl.int32, list(shape)))
    return call
