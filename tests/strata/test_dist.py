"""Several processes on loopback (gloo): --ep, --pp and both give the one-process logits and
tokens; a rank that dies ends the run with its name; bench model --ep reports the bytes
sent. Each test starts torchrun (python -m torch.distributed.run) with one thread a rank."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.strata import dist_run

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]



def _stop(p: subprocess.Popen) -> None:
    """End a torchrun and its ranks: SIGTERM, which torchrun passes to its workers before it
    exits (a SIGKILL to its process group alone left a rank running after the test), then
    SIGKILL to the group if it has not ended in 30 s."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

def _torchrun(n: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def one_process(flash_tiny_gguf):
    """The reference: the same computation in this process, one thread (as each rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return dist_run.run(flash_tiny_gguf.path)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow  # torchrun and its ranks start torch each: 15 s the smallest run
@pytest.mark.parametrize("ep,pp", [(2, 1), (1, 2), (2, 2)])
def test_ranks_give_the_one_process_logits(ep, pp, one_process, tmp_path):
    out = tmp_path / "rank0.npz"
    r = _torchrun(ep * pp, str(HERE / "dist_run.py"), str(out), str(ep), str(pp))
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(out)
    ref = one_process["logits"]
    # float32: the pipeline hands the same numbers on (bit for bit); the shares' partial
    # expert sums are added in another order than one process adds the experts
    err = np.abs(got["logits"] - ref).max() / np.abs(ref).max()
    assert err <= 1e-6, f"--ep {ep} --pp {pp}: logits differ by {err:.2e} of the largest"
    if ep == 1:
        assert err == 0.0
    assert got["tokens"].tolist() == one_process["tokens"].tolist()


@pytest.mark.slow
def test_generate_cli_ep2_pp2_gives_the_one_process_text(flash_tiny_gguf):
    from strata.load import load_model
    from strata.runtime import SamplingParams, generate
    from strata.tokenizer import Tokenizer
    prompt = "The capital of France is"
    tok = Tokenizer.from_gguf(flash_tiny_gguf)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model(flash_tiny_gguf, torch.float32, "cpu", "torch")
        want = generate(model, tok, tok.encode(prompt), SamplingParams(temperature=0.0, max_tokens=8)).text
    finally:
        torch.set_num_threads(threads)
    r = _torchrun(4, "-m", "strata", "generate", prompt, "--raw", "-m", str(flash_tiny_gguf.path), "--dtype", "f32",
                  "-t", "1", "--temperature", "0", "-n", "8", "--ep", "2", "--pp", "2", "--layer-split", "3",
                  "--ple-io", "ram")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == want.strip()
    # rank 0 alone prints its plan; the others stay quiet
    assert r.stderr.count("parallel: rank 0 of 4 (--ep 2 --pp 2): stage 0, layers 0-2, experts 0-31") == 1
    assert "parallel: rank 1" not in r.stderr


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_run_naming_it(flash_tiny_gguf, tmp_path):
    log = tmp_path / "out.txt"
    # no compiles: rank 1 dies 3 s after loading, when rank 0 must already be decoding (a
    # rank still compiling is ended by torchrun's agent before it reaches a collective)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), STRATA_CPU_COMPILE="0")
    # torchrun's agent checks its workers every 5 s here (0.1 s by default): the test is of
    # Strata's own report, which must come first; the agent's SIGTERM to rank 0 would race it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "--monitor-interval", "5",
           "-m", "strata", "generate", "Once upon a time", "--raw", "-m", str(flash_tiny_gguf.path),
           "--dtype", "f32", "-t", "1", "--temperature", "0", "-n", "3000", "--ep", "2",
           "--ple-io", "ram", "--plan-all-ranks", "--dist-timeout", "60"]
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        pid, deadline = None, time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:
            text = log.read_text()
            m = re.search(r"\[rank 1\] parallel: .*, pid (\d+)", text)
            if m and text.count("Flash Tiny (qwen4exp") == 2:  # both loaded: generating
                time.sleep(3)
                pid = int(m.group(1))
                break
            time.sleep(0.5)
        assert pid is not None, log.read_text()[-3000:]
        os.kill(pid, signal.SIGKILL)
        t = time.monotonic()
        p.wait(timeout=60)
        took = time.monotonic() - t
    finally:
        _stop(p)
    text = log.read_text()
    assert p.returncode != 0
    assert took < 60, f"the run took {took:.0f} s to end after rank 1 died"
    assert re.search(r"strata: rank 0: rank 1 (is gone|did not answer)", text), text[-3000:]


@pytest.mark.slow
def test_bench_model_ep2_reports_bytes_sent_beside_one_process(flash_tiny_gguf):
    r = _torchrun(2, "-m", "strata", "bench", "model", "-m", str(flash_tiny_gguf.path), "--ep", "2", "-t", "1",
                  "-p", "16", "-n", "4", "-r", "1", "--dtype", "f32", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    res = json.loads(r.stdout[r.stdout.index("{"):])
    rows = {(row["engine"], row["test"]): row for row in res["rows"]}
    both = rows["strata --ep 2 --pp 1 (2 processes)", "tg4"], rows["strata (1 process)", "tg4"]
    assert both[0]["tok_s"] > 0 and both[1]["tok_s"] > 0
    # a decode token: one all-reduce of the MoE output (dim float32) per layer, each of the
    # 2 ranks sending half of it twice (ring): 8 layers x 256 x 4 bytes x 2 ranks
    g = flash_tiny_gguf
    layers, dim = int(g.require("qwen4exp.block_count")), int(g.require("qwen4exp.embedding_length"))
    assert both[0]["bytes_sent_per_token"] == layers * dim * 4 * 2 * (2 * (2 - 1) / 2)
    assert both[1]["bytes_sent_per_token"] == 0


def test_ep_without_torchrun_says_how_to_start_it(flash_tiny_gguf, capsys):
    from strata.cli import main
    assert main(["generate", "x", "-m", str(flash_tiny_gguf.path), "--ep", "2"]) == 2
    assert "torchrun --nproc-per-node 2 -m strata" in capsys.readouterr().err
    assert main(["chat", "-m", str(flash_tiny_gguf.path), "--pp", "2"]) == 2
    assert "`strata chat` runs in one process" in capsys.readouterr().err


def test_layout_splits_layers_and_experts():
    from strata.dist import Layout
    L = Layout(ep=2, pp=4, rank=5, split=(13, 26, 38))
    assert (L.stage, L.share) == (2, 1)
    assert L.layers(48) == range(26, 38)
    assert L.experts(512) == range(256, 512)
    assert Layout(ep=3, rank=0).experts(8) == range(0, 3) and Layout(ep=3, rank=2).experts(8) == range(6, 8)
    assert Layout(pp=3, rank=2).layers(8) == range(5, 8)
    with pytest.raises(ValueError, match="split points"):
        Layout(pp=2, rank=0, split=(3, 5))
    with pytest.raises(ValueError, match="cannot be split"):
        Layout(pp=2, rank=0, split=(9,)).layers(8)


@pytest.mark.slow
def test_serve_ep2_pp2_answers_as_one_process(flash_tiny_gguf):
    import concurrent.futures as cf
    import socket

    import httpx

    from strata.load import load_model
    from strata.runtime import SamplingParams, generate
    from strata.tokenizer import Tokenizer
    from triton_kernels import invariant
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "strata", "serve", "-m", str(flash_tiny_gguf.path), "--dtype", "f32", "-t", "1",
           "--ep", "2", "--pp", "2", "--ple-io", "ram", "--port", str(port)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT,
                         start_new_session=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1000, 50000, n).tolist() for n in (20, 70)]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert p.poll() is None, "the server ended before it was ready"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)

        def ask(ids):
            r = httpx.post(f"{url}/v1/completions", timeout=120,
                           json={"prompt": ids, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with cf.ThreadPoolExecutor(2) as ex:  # two slots batched, then the first again from the cache
            got = list(ex.map(ask, prompts)) + [ask(prompts[0])]
    finally:
        _stop(p)
    tok = Tokenizer.from_gguf(flash_tiny_gguf)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model(flash_tiny_gguf, torch.float32, "cpu", "torch")
        with invariant.batch_invariant(True):  # serve's numerics
            want = [generate(model, tok, ids, SamplingParams(temperature=0.0, max_tokens=8)).text
                    for ids in prompts]
    finally:
        torch.set_num_threads(threads)
    assert got == want + want[:1]


def test_plan_across_ranks_for_the_real_shapes(capsys):
    from strata.cli import main
    assert main(["plan", "flash-next", "--ep", "8", "--device", "cuda", "--gpu-mem", "141"]) == 0
    out = capsys.readouterr().out
    # 512 experts over 8 shares; a decoded token: 48 layers x 8 ranks x 2 (8-1)/8 x 2560 float32
    assert "64 of 512 experts a layer" in out and ": fits" in out
    assert f"sent a decoded token: {48 * 8 * 2 * 7 / 8 * 2560 * 4 / 2**20:.2f} MiB" in out
    assert "break-even link:" in out
    assert main(["plan", "flash-next", "--ep", "2", "--pp", "4", "--layer-split", "13,26,38", "--gpu-mem", "141"]) == 0
    out = capsys.readouterr().out
    assert "stage 3 (ranks 6-7): layers 38-47" in out and "logits broadcast" in out


@pytest.mark.slow
def test_serve_fails_the_requests_in_flight_and_answers_503_naming_the_lost_rank(flash_tiny_gguf, tmp_path):
    import socket
    import threading

    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    # torchrun stops every worker once one has failed, checking every --monitor-interval
    # seconds (0.1 by default): 30 here leaves rank 0 up to show what it answers meanwhile
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "30",
           "-m", "strata", "serve", "-m", str(flash_tiny_gguf.path), "--dtype", "f32", "-t", "1",
           "--ep", "2", "--ple-io", "ram", "--port", str(port), "--plan-all-ranks", "--dist-timeout", "60"]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert p.poll() is None, log.read_text()[-3000:]
            m = re.search(r"\[rank 1\] Flash Tiny", log.read_text())  # rank 1 has loaded too
            try:
                if m and httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        pid = int(re.search(r"\[rank 1\] parallel: .*, pid (\d+)", log.read_text()).group(1))
        answer = {}
        long = threading.Thread(target=lambda: answer.update(r=httpx.post(
            f"{url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0},
            timeout=120)))
        long.start()
        time.sleep(3)  # decoding
        os.kill(pid, signal.SIGKILL)
        long.join(120)
        r = answer["r"]
        assert r.status_code == 500 and "rank 1 is gone" in r.json()["error"]["message"], r.text
        h = httpx.get(f"{url}/health")
        assert h.status_code == 503 and "rank 1 is gone" in h.json()["message"]
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert late.status_code == 503 and "rank 1" in late.json()["error"]["message"]
        # torchrun's monitor would end the run within 30 s (test_a_rank_that_dies_ends_the_run_naming_it
        # checks that the run ends naming the rank): stopped here instead
    finally:
        _stop(p)


@pytest.mark.slow
def test_perplexity_pp2_gives_the_one_process_ppl(flash_tiny_gguf, tmp_path):
    from strata.cli import main
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    args = ["perplexity", str(flash_tiny_gguf.path), "--text", str(text), "--ctx", "64", "--chunks", "2",
            "--dtype", "f32", "-t", "1", "--json"]
    threads = torch.get_num_threads()
    try:
        import contextlib
        import io
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(args) == 0
    finally:
        torch.set_num_threads(threads)
    one = _json_tail(out.getvalue())
    r = _torchrun(2, "-m", "strata", *args, "--pp", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    two = _json_tail(r.stdout)
    assert two["ppl"] == one["ppl"]  # a pipeline hands the same numbers on


def _json_tail(text: str) -> dict:
    import json
    return json.loads(text[text.index("{"):])


def test_a_lost_rank_is_named_from_any_collective():
    """Rank 0 waiting in a broadcast (serve's next call) when a rank's process has ended or
    is a zombie (torchrun reaps its workers later): the error names that rank; where no
    process on this host is seen to end, the peers of the collective are named, never the
    broadcast's root itself."""
    import socket
    import types

    from strata.dist import Comm, Layout, RankLost
    host, me = socket.gethostname(), os.getpid()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(1.0)  # exited, not yet waited on

    def comm(ep, pids):
        c = Comm.__new__(Comm)
        c.layout, c.timeout_s = Layout(ep=ep, rank=0), 60.0
        c._pids = {r: f"{host}:{pid}" for r, pid in enumerate(pids)}

        def fail(*a, **k):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        c.dist = types.SimpleNamespace(broadcast_object_list=fail)
        return c

    try:
        for gone in (dead.pid, zombie.pid):  # rank 2 of 3 gone, rank 1 alive
            with pytest.raises(RankLost, match=r"^rank 0: rank 2 is gone during the broadcast"):
                comm(3, [me, me, gone]).broadcast_object(("forward",), "the broadcast of the engine's next call")
        with pytest.raises(RankLost, match=r"^rank 0: rank 1 is gone during the broadcast"):
            comm(2, [me, me]).broadcast_object(("forward",), "the broadcast of the engine's next call")
    finally:
        zombie.wait()
