"""The suite's two tiers. The full suite (`CI=true python -m pytest -n 2`, what CI runs)
draws every property's examples as its test says; the quick tier (`-m "not slow"`, set
by tests/conftest.py's pytest_configure before any test module is imported) leaves out
the tests marked slow and draws at most QUICK examples a property."""
QUICK = 2

quick = False


def examples(n: int) -> int:
    """A property's max_examples: n, or at most QUICK in the quick tier."""
    return min(n, QUICK) if quick else n
