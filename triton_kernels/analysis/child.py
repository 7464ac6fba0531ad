"""A child process that compiles without the interpreter, kept for the calls that follow.

Under TRITON_INTERPRET=1 (the tests, a notebook) every @triton.jit function is an
interpreted one, so the static analysis compiles in a child process without it. Starting
one costs seconds (importing torch and triton, hashing Triton's sources: 3-4 s of one
core here), more than compiling a kernel or two; so the child stays and serves the next
call. It serves one module's `serve(request) -> reply` (JSON), one call at a time, and is
started again when the caller's environment or working directory changes: each call runs
as a fresh child started then would, and compiles what an earlier call compiled no faster
than Triton's cache makes it (what a process that compiles many kernels does anyway).

    call("triton_kernels.analysis.static", {...}) -> reply
"""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback

# variables that name the caller's place and change nothing compiled: pytest sets this one
# at every test
_NAMES_ONLY = {"PYTEST_CURRENT_TEST"}
_lock = threading.Lock()
_children: dict = {}  # module -> (key, Popen, stderr file)


def call(module: str, request: dict) -> dict:
    """module.serve(request) in the child; RuntimeError with the child's traceback (or its
    stderr, where it died) where it failed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    key = (sorted((k, v) for k, v in env.items() if k not in _NAMES_ONLY), os.getcwd())
    with _lock:
        held = _children.get(module)
        if held is None or held[0] != key or held[1].poll() is not None:
            _stop(module)
            err = tempfile.TemporaryFile("w+")  # a file: a pipe left unread fills and blocks
            proc = subprocess.Popen([sys.executable, "-m", __name__, module], env=env, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
            held = _children[module] = (key, proc, err)
        _, proc, err = held
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:  # it died
            proc.wait()
            err.seek(0)
            tail = err.read()[-4000:]
            _stop(module)
            raise RuntimeError(f"{module} failed in its child process (exit {proc.returncode}):\n{tail}")
    reply = json.loads(line)
    if "error" in reply:
        raise RuntimeError(f"{module} failed in its child process:\n{reply['error'][-4000:]}")
    return reply


def _stop(module: str) -> None:
    held = _children.pop(module, None)
    if held is None:
        return
    _, proc, err = held
    if proc.poll() is None:
        proc.stdin.close()  # its loop ends at the end of its input
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    err.close()


@atexit.register
def _stop_all() -> None:
    for module in list(_children):
        _stop(module)


def _serve(module: str) -> None:
    """The child: one JSON request a line in, one reply a line out; what else the work
    prints goes to stderr."""
    import importlib
    serve = importlib.import_module(module).serve
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        try:
            reply = serve(json.loads(line))
        except Exception:  # the caller raises it, with this traceback
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
