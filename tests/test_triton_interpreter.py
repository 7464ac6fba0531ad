"""tests/triton_interpreter.py's kept type checks against Triton's own.

The suite's interpreter checks, casts and broadcasts the operands of a binary operation by
kept tables (`_type_checks_kept`): computation types per pair of element types, integer
constants splatted once per shape, blocks broadcast over lists of ints. Every kernel
property in the suite rests on those giving what Triton's semantic code gives; here they
are held to it on drawn operands (every plain element type, pointers, scalars and blocks
of broadcastable and clashing shapes, Python ints and floats in and out of range, NaN and
-0.0), the answer compared bit for bit: each result's types, its handle's element type and
its data's dtype, shape and bytes; or the same exception with the same message.
"""
import numpy as np
import pytest
import triton.language as tl
from hypothesis import given, settings, strategies as st

from tests.tiers import examples
from tests.triton_interpreter import kept_checks, triton_checks
from triton_kernels.backend import interpreter_on

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="the suite's interpreter patches run under "
                                                             "TRITON_INTERPRET=1 only (the suite sets it)")

PLAIN = [tl.int1, tl.int8, tl.int16, tl.int32, tl.int64, tl.uint8, tl.uint16, tl.uint32, tl.uint64,
         tl.float16, tl.bfloat16, tl.float32, tl.float64]
SHAPES = [None, (1,), (4,), (1, 4), (2, 1), (2, 4), (8, 4), (2, 2, 4), (2, 1, 4)]  # None: a scalar
# mostly a few values, so that the kept constants are read back against other shapes and types
NUMBERS = st.one_of(st.sampled_from([0, 1, -1, 15, 2 ** 31 - 1, 2 ** 31, 2 ** 32, -2 ** 31 - 1, 2 ** 63, 2 ** 64,
                                     0.0, -0.0, 0.5, float("nan"), float("inf"), 1e-40, 3.5e38]),
                    st.integers(-2 ** 65, 2 ** 65), st.floats(allow_nan=True, allow_infinity=True))


def _semantic():
    import triton.runtime.interpreter as ti
    return ti, ti.interpreter_semantic


@st.composite
def operand(draw, number: bool = True):
    """A Python number (where `number`) or a tensor: a scalar or a block, of a plain
    element type or a pointer to one, holding any bytes."""
    ti, _ = _semantic()
    if number and draw(st.integers(0, 4)) == 0:
        return draw(NUMBERS)
    pointer = draw(st.integers(0, 5)) == 0
    element = draw(st.sampled_from(PLAIN))
    dtype = tl.pointer_type(element) if pointer else element
    shape = draw(st.sampled_from(SHAPES))
    np_dtype = ti._get_np_dtype(dtype)
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * np_dtype.itemsize, max_size=n * np_dtype.itemsize))
    data = np.frombuffer(raw, dtype=np_dtype).copy()
    if np_dtype == np.bool_:
        data = data.view(np.uint8) & 1 != 0
    data = data.reshape(shape or (1,))
    ty = tl.block_type(dtype, list(shape)) if shape else dtype
    return tl.tensor(ti.TensorHandle(data, dtype), ty)


def _outcome(check, lhs, rhs, flags) -> tuple:
    try:
        got = check(lhs, rhs, *flags)
    except Exception as e:  # the same error, the same words
        return "raised", type(e).__name__, str(e)
    return tuple((str(t.type), type(t.type).__name__, str(t.handle.dtype), t.handle.data.dtype.str,
                  t.handle.data.shape, t.handle.data.tobytes()) for t in got)


def test_the_suites_interpreter_keeps_its_checks():
    _, sem = _semantic()
    assert kept_checks, "tests/triton_interpreter.py: _type_checks_kept left this Triton release alone"
    for name, fn in kept_checks.items():
        assert getattr(sem, name) is fn
    with triton_checks():
        assert not any(name in vars(sem) for name in kept_checks)
    assert all(getattr(sem, name) is fn for name, fn in kept_checks.items())


@st.composite
def case(draw):
    """lhs, rhs (two numbers make no tensor operation) and the flags: allow_lhs_ptr,
    allow_rhs_ptr, arithmetic_check, div_or_mod."""
    lhs = draw(operand())
    rhs = draw(operand(number=isinstance(lhs, tl.tensor)))
    return lhs, rhs, draw(st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()))


@settings(max_examples=examples(300))
@given(cases=st.lists(case(), min_size=1, max_size=6))
def test_kept_checks_give_tritons_answer(cases):
    """Each case runs twice on the kept checks, so that the second reads what the first
    kept, and beside others that may share its constant or its types."""
    _, sem = _semantic()
    for lhs, rhs, flags in cases:
        with triton_checks():
            want = _outcome(sem.binary_op_type_checking_impl, lhs, rhs, flags)
        for _ in range(2):
            assert _outcome(sem.binary_op_type_checking_impl, lhs, rhs, flags) == want, (lhs, rhs, flags)


@pytest.mark.parametrize("dtype", [tl.float16, tl.float32, tl.int32, tl.uint8])
def test_numbers_that_compare_equal_are_kept_apart(dtype):
    """0.0 and -0.0, 1 and 1.0 are equal keys to a dict, not equal constants to a kernel."""
    ti, sem = _semantic()
    block = tl.tensor(ti.TensorHandle(np.ones((2, 4), ti._get_np_dtype(dtype)), dtype), tl.block_type(dtype, [2, 4]))
    for number in (0.0, -0.0, 0, 1, 1.0, -0.0, 0.0, 1.0, 1):
        for order in ((block, number), (number, block)):
            with triton_checks():
                want = _outcome(sem.binary_op_type_checking_impl, *order, (False, False, True, False))
            assert _outcome(sem.binary_op_type_checking_impl, *order, (False, False, True, False)) == want, number
