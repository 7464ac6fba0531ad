import os

# Each xdist worker computes on one thread: two workers already fill the two cores, and
# thread teams spinning against each other make small ops 100-1000x slower (measured: a
# 64x512 @ 512x64 float32 matmul in numpy, 0.19 ms on one OpenBLAS thread, 64 ms on two
# on a busy machine; the interpreter's tl.dot is such a matmul). OpenBLAS reads its count
# when numpy first loads, which no plugin has done yet; torch's is set below.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# The Triton kernels run through the interpreter on the CPU: this must be set before
# anything imports triton. STRATA_TEST_DEVICE=cuda (scripts/gpu_check.sh) leaves it off, so
# that the tests marked `cuda` run the compiled kernels on the GPU.
ON_DEVICE = os.environ.get("STRATA_TEST_DEVICE") == "cuda"

# No background compile in a test worker (a chat or a server started in-process would leave
# its compile thread running into later tests, and make them take the compiled steps): a
# short run compiles nothing by default anyway. The tests of the compiled paths and of the
# background compile set STRATA_CPU_COMPILE themselves (tests/strata/test_cpu_compile.py).
os.environ.setdefault("STRATA_CPU_COMPILE", "0")
if not ON_DEVICE:
    os.environ["TRITON_INTERPRET"] = "1"
    from tests.triton_interpreter import install, instructions_by_their_models  # noqa: E402

    install()  # the interpreter patches triton.language once a launch, not once a call
    instructions_by_their_models()  # dp4a, pack16 and prmt in one step, not 5 to 40
    from triton_kernels.backend import interpreter_check  # noqa: E402

    interpreter_check()  # one clear error, not one deep in Triton per test



def _transformers_without_fla():
    """transformers 5.23 (the qwen4exp reference) swaps fla-core's kernels in for its torch
    gated delta rule whenever `fla` imports (transformers/integrations/hub_kernels.py), CPU
    tensors included, where they fail ("0 active drivers"): where the `cuda` extra is
    installed, the reference keeps its torch math, and Strata's tests still reach fla."""
    import importlib
    import importlib.util
    import sys
    if importlib.util.find_spec("fla") is None:
        return
    real = importlib.import_module

    def import_module(name, package=None):
        if name.split(".")[0] == "fla" and sys._getframe(1).f_code.co_filename.endswith("hub_kernels.py"):
            raise ImportError("tests/conftest.py: transformers' reference runs its torch gated delta rule")
        return real(name, package)
    importlib.import_module = import_module


_transformers_without_fla()

from hypothesis import HealthCheck, settings  # noqa: E402

# 200 examples per property; CI (CI=true, as CI services and .ci/run set it; not CI=false)
# also derandomises, as Hypothesis' own ci profile.
settings.register_profile("strata", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])
# (filter_too_much: drawing many fp16 scales at once rejects often; it costs time, not rigour)
settings.register_profile("strata-ci", parent=settings.get_profile("strata"), derandomize=True,
                          database=None, print_blob=True)
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
settings.load_profile("strata-ci" if CI else "strata")

# torch's thread count for each xdist worker (see OPENBLAS_NUM_THREADS above)
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch  # noqa: E402
    torch.set_num_threads(1)


def pytest_configure(config):
    """`-m "not slow"` is the quick tier (tests/tiers.py): the properties draw a few examples
    each, whether from the profile or from their own @settings(max_examples=examples(n))."""
    if "not slow" in (config.getoption("markexpr") or ""):
        from tests import tiers
        tiers.quick = True
        settings.register_profile("strata-quick", parent=settings.get_profile("strata-ci" if CI else "strata"),
                                  max_examples=tiers.QUICK)
        settings.load_profile("strata-quick")


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU and the compiled kernels: skipped elsewhere, with the
    command that runs them."""
    import pytest
    if ON_DEVICE:
        import torch
        if torch.cuda.is_available():
            return
    # a test may say where CI covers what it checks: @pytest.mark.cuda(ci="...")
    ci = "CI runs the same kernels and properties under the Triton interpreter in tests/triton_kernels"
    for item in items:
        mark = item.get_closest_marker("cuda")
        if mark is not None:
            item.add_marker(pytest.mark.skip(
                reason=f"needs a CUDA device (scripts/gpu_check.sh runs it); {mark.kwargs.get('ci', ci)}"))
