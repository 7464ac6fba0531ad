"""`strata serve` driven over loopback with the official openai client (SmolLM2).

The servers here compute in f32. With bf16 (the default) batching still changes nothing
(every output row of a matmul is its own dot products: checked bit for bit), but a reused
prefix changes how the attention of the tokens after it is summed, and bf16 rounding of
the activations can turn that 1e-7 difference into another greedy token at a near-tie. In
f32 such differences stay near 1e-6 of the logits, far below the margins of these prompts.
"""
import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "strata", "serve", "--port", str(self.port),
                                      "-t", "2", "--dtype", "f32", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ))
        self.health = []  # status codes seen while starting
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                code = httpx.get(self.url + "/health", timeout=2).status_code
                self.health.append(code)
                if code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()[-2000:]}")
            time.sleep(0.1)
        else:
            raise RuntimeError("server did not become healthy in 120 s")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics").text
        return {l.split()[0]: float(l.split()[1]) for l in text.splitlines() if l and not l.startswith("#")}

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    s = Server("--slots", "4")
    yield s
    s.stop()


CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def chat(server, messages=CHAT, **kw):
    return server.client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                                 max_tokens=kw.pop("max_tokens", 24), **kw)


def test_health_was_503_while_loading(server):
    assert 503 in server.health and server.health[-1] == 200


def test_models(server):
    assert [m.id for m in server.client.models.list().data] == ["smollm2"]


def test_chat_stream_equals_non_stream(server):
    full = chat(server)
    assert full.choices[0].message.content and full.choices[0].finish_reason in ("stop", "length")
    chunks = list(chat(server, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-2].choices[0].finish_reason is not None  # on the last content chunk
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_usage_and_stream(server):
    prompt = "The three primary colours are"
    full = server.client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=12)
    ids = httpx.post(server.url + "/tokenize", json={"content": prompt}).json()["tokens"]
    assert full.usage.prompt_tokens == len(ids)
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    streamed = server.client.completions.create(model="smollm2", prompt=prompt, temperature=0,
                                                max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["content"]
    assert back == prompt


@pytest.mark.parametrize("body,words", [
    (b"{not json", "JSON"),
    (json.dumps({"messages": CHAT, "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"messages": CHAT, "max_tokens": 10 ** 6}).encode(), "exceeds the context size"),
    (json.dumps({"messages": CHAT, "model": "gpt-9"}).encode(), "not served here"),
    (json.dumps({"messages": []}).encode(), "messages"),
])
def test_bad_requests_get_400_and_the_server_goes_on(server, body, words):
    r = httpx.post(server.url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error" and err["code"]
    assert chat(server, max_tokens=4).choices[0].message.content


def test_batching_does_not_change_greedy_output(server):
    alone = chat(server).choices[0].message.content
    others = [[{"role": "user", "content": f"Write a sentence about the number {i}."}] for i in range(3)]
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(chat, server)] + [ex.submit(chat, server, m) for m in others]
        assert futs[0].result().choices[0].message.content == alone
        for f in futs[1:]:
            f.result()


def test_conversation_cache_reuses_the_shared_prefix(server, smollm2_gguf):
    turn1 = chat(server, [{"role": "user", "content": "Tell me a fact about owls."}])
    history = [{"role": "user", "content": "Tell me a fact about owls."},
               {"role": "assistant", "content": turn1.choices[0].message.content},
               {"role": "user", "content": "And one about cats?"}]
    turn2 = chat(server, history)
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    assert cached >= turn1.usage.prompt_tokens  # only the new turn was evaluated
    # the same second turn on a server without a conversation cache
    cold = Server("--slots", "1", "--conversation-cache-mib", "0")
    try:
        again = chat(cold, history)
        assert again.usage.prompt_tokens_details.cached_tokens == 0
        assert again.choices[0].message.content == turn2.choices[0].message.content
    finally:
        cold.stop()


def test_load_64_requests_16_clients_no_mixups_no_leaks(server):
    prompts = [f"Count upward starting from {i}:" for i in range(16)]
    ask = lambda p: server.client.completions.create(model="smollm2", prompt=p, temperature=0,  # noqa: E731
                                                     max_tokens=8).choices[0].text
    solo = {p: ask(p) for p in prompts}
    with cf.ThreadPoolExecutor(16) as ex:
        jobs = [(p, ex.submit(ask, p)) for p in prompts * 4]
        for p, f in jobs:
            assert f.result() == solo[p]
    # clients that hang up mid-stream: their slots come free
    for _ in range(4):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": "Tell me a long story.", "max_tokens": 400, "stream": True}) as r:
            next(r.iter_lines())
    deadline = time.time() + 20
    while server.metrics()["strata_busy_slots"] > 0 and time.time() < deadline:
        time.sleep(0.2)
    m = server.metrics()
    assert m["strata_busy_slots"] == 0 and m["strata_queue_length"] == 0
