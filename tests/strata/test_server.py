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
import random
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.tiers import examples


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`strata serve` in a child process, on one thread: the suite's two workers already fill
    the two cores, and a second thread waits at every op for a core (tests/conftest.py)."""

    def __init__(self, *args: str, key: str | None = None, dtype: str = "f32", timeout: float = 120):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "strata", "serve", "--port", str(self.port),
                                      "-t", "1", "--dtype", dtype, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ))
        # one pooled client for every request: `httpx.get` builds a client, its SSL context
        # included, for every call (about 50 ms of CPU here); polled 10 times a second, that
        # took half a core from the server starting beside it
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.health = []  # status codes seen while starting
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                code = self.http.get("/health", timeout=2).status_code
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
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0,
                                    timeout=timeout)

    def metrics(self) -> dict:
        text = self.http.get("/metrics").text
        return {l.split()[0]: float(l.split()[1]) for l in text.splitlines() if l and not l.startswith("#")}

    def stop(self):
        self.http.close()
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
    ids = server.http.post("/tokenize", json={"content": prompt}).json()["tokens"]
    assert full.usage.prompt_tokens == len(ids)
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    streamed = server.client.completions.create(model="smollm2", prompt=prompt, temperature=0,
                                                max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    back = server.http.post("/detokenize", json={"tokens": ids}).json()["content"]
    assert back == prompt


@pytest.mark.parametrize("body,words", [
    (b"{not json", "JSON"),
    (json.dumps({"messages": CHAT, "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"messages": CHAT, "max_tokens": 10 ** 6}).encode(), "exceeds the context size"),
    (json.dumps({"messages": CHAT, "model": "gpt-9"}).encode(), "not served here"),
    (json.dumps({"messages": []}).encode(), "messages"),
])
def test_bad_requests_get_400_and_the_server_goes_on(server, body, words):
    r = server.http.post("/v1/chat/completions", content=body,
                         headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error" and err["code"]
    assert chat(server, max_tokens=4).choices[0].message.content


@pytest.mark.slow
def test_batching_does_not_change_greedy_output(server):
    alone = chat(server).choices[0].message.content
    others = [[{"role": "user", "content": f"Write a sentence about the number {i}."}] for i in range(3)]
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(chat, server)] + [ex.submit(chat, server, m) for m in others]
        assert futs[0].result().choices[0].message.content == alone
        for f in futs[1:]:
            f.result()


OWLS = ("Owls hunt at night over fields and woods, turning their heads to listen for mice in the "
        "grass, and they fly without a sound because of the soft fringes on their feathers. "
        "Tell me one more fact about owls.")


@pytest.mark.slow
def test_conversation_cache_reuses_the_shared_prefix(server, smollm2_gguf):
    from strata.server.engine import PREFILL_CHUNK
    turn1 = chat(server, [{"role": "user", "content": OWLS}])
    history = [{"role": "user", "content": OWLS},
               {"role": "assistant", "content": turn1.choices[0].message.content},
               {"role": "user", "content": "And one about cats?"}]
    turn2 = chat(server, history)
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    # the first turn's prompt, in whole prefill chunks, came from the cache
    assert turn1.usage.prompt_tokens >= PREFILL_CHUNK
    assert cached == turn1.usage.prompt_tokens // PREFILL_CHUNK * PREFILL_CHUNK
    # the same second turn on a server without a conversation cache
    cold = Server("--slots", "1", "--conversation-cache-mib", "0")
    try:
        again = chat(cold, history)
        assert again.usage.prompt_tokens_details.cached_tokens == 0
        assert again.choices[0].message.content == turn2.choices[0].message.content
    finally:
        cold.stop()


@pytest.fixture(scope="module")
def guarded(smollm2_gguf):
    s = Server("--slots", "1", "--queue", "1", "--api-key", "s3cret", "--max-request-bytes", "4096",
               "--max-prompt-tokens", "64", "--max-tokens", "2", key="s3cret")
    yield s
    s.stop()


@pytest.mark.slow  # a second server; the quick tier serves through `server` above
def test_the_api_key_keeps_strangers_out(guarded):
    assert guarded.http.get("/health").status_code == 200  # a load balancer needs no key
    for path, method in (("/v1/models", "GET"), ("/metrics", "GET"), ("/v1/chat/completions", "POST"),
                         ("/tokenize", "POST")):
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = guarded.http.request(method, path, headers=auth, json={"content": "hi"})
            assert r.status_code == 401, (path, auth)
            err = r.json()["error"]
            assert "--api-key" in err["message"] and err["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
    stranger = openai.OpenAI(base_url=guarded.url + "/v1", api_key="guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    assert guarded.client.models.list().data[0].id == "smollm2"


@pytest.mark.slow  # a second server; the quick tier serves through `server` above
def test_request_bounds_are_named(guarded):
    key = {"Authorization": "Bearer s3cret"}
    big = json.dumps({"prompt": "x" * 5000}).encode()
    for headers in (key, {**key, "Transfer-Encoding": "chunked"}):
        body = big if "Transfer-Encoding" not in headers else iter([big[:3000], big[3000:]])
        r = guarded.http.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 413 and "4,096 bytes" in r.json()["error"]["message"], headers
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        guarded.client.completions.create(model="smollm2", prompt="word " * 200)
    assert guarded.client.completions.create(model="smollm2", prompt="Hi").choices[0].text is not None


@pytest.mark.slow  # a second server; the quick tier serves through `server` above
def test_a_full_queue_answers_503_with_retry_after(guarded):
    """One slot and a queue of one: of several long requests at once, the ones that find
    both taken get 503 with Retry-After, through the openai client too."""
    def ask(_):
        return guarded.http.post("/v1/completions", headers={"Authorization": "Bearer s3cret"},
                                 json={"prompt": "Tell me a long story.", "max_tokens": 48, "temperature": 0}, timeout=120)
    with cf.ThreadPoolExecutor(6) as ex:
        codes = [r for r in ex.map(ask, range(6))]
    busy = [r for r in codes if r.status_code == 503]
    assert busy and all(r.headers["retry-after"] for r in busy) and any(r.status_code == 200 for r in codes)
    assert busy[0].json()["error"]["code"] == "queue_full"


@pytest.mark.slow
def test_sampling_parameters_take_effect(server):
    def ask(top_k=None, min_p=None, **kw):  # llama-server's top_k and min_p go as extra fields
        extra = {k: v for k, v in (("top_k", top_k), ("min_p", min_p)) if v is not None}
        return server.client.completions.create(model="smollm2", prompt="My favourite animal is", max_tokens=12,
                                                extra_body=extra, **kw).choices[0].text
    greedy = ask(temperature=0)
    assert ask(temperature=1.0, top_k=1) == greedy  # one candidate left: the greedy token
    seeded = ask(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    assert ask(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7) == seeded  # a seed repeats
    others = {ask(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=s) for s in range(1, 5)}
    assert len(others | {seeded}) > 1  # and other seeds draw otherwise
    stopped = server.client.completions.create(model="smollm2", prompt="Count: 1, 2, 3,", max_tokens=24,
                                               temperature=0, stop=[","])
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    short = server.client.completions.create(model="smollm2", prompt="Hi", max_tokens=3, temperature=0)
    assert short.usage.completion_tokens <= 3 and short.choices[0].finish_reason in ("length", "stop")


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=20), lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=8)
_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "min_p", "seed", "stop", "stream", "stream_options", "content", "tokens", "add_special"]
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _JSON,
                                  "content": st.text(max_size=30) | _JSON})


@st.composite
def _bodies(draw):
    """A request body: random JSON for the known fields (and some unknown ones), or bytes
    that are not JSON at all. Token budgets stay small, so that a body that is valid costs
    a token or two."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=64))
    body = draw(st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=6), _JSON, max_size=6))
    if draw(st.booleans()):
        body["messages"] = draw(st.lists(_MESSAGE, max_size=3) | _JSON)
    if draw(st.booleans()):
        body["prompt"] = draw(st.text(max_size=40) | st.lists(st.integers(-5, 60000), max_size=6) | _JSON)
    if isinstance(body.get("max_tokens"), int) or "max_tokens" not in body:
        body["max_tokens"] = draw(st.integers(-3, 1))
    body.pop("max_completion_tokens", None)
    return json.dumps(body).encode()


@settings(max_examples=examples(500), deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]),
       body=_bodies())
@pytest.mark.slow
def test_fuzzed_bodies_get_4xx_with_an_error_and_the_next_request_is_served(server, path, body):
    r = server.http.post(path, content=body, headers={"content-type": "application/json"})
    if r.status_code != 200:
        assert 400 <= r.status_code < 500, (r.status_code, body, r.text[:300])
        err = r.json()["error"]
        assert err["message"] and err["type"] and err["code"], r.text
    # the next request is served: the engine's tokenizer each time, a whole completion
    # (a model step) after every twenty
    assert server.http.post("/tokenize", json={"content": "Hi"}).json()["tokens"]
    _fuzzed[0] += 1
    if _fuzzed[0] % 20 == 0:
        good = server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"]


_fuzzed = [0]


@pytest.mark.slow
def test_the_same_answer_whatever_the_cache_and_the_company():
    """bf16, the conversation cache on (the defaults): 8 prompts asked alone, then again
    among 32 requests from 16 clients on 4 slots: every answer is the same, token for
    token. The prompts share a system message longer than a prefill chunk, which the
    cache reuses. Then clients that hang up mid-stream leave no slot busy."""
    # 32 requests queue behind 4 slots: on a loaded machine the last wait minutes
    s = Server("--slots", "4", dtype="bf16", timeout=900)
    system = {"role": "system", "content": OWLS + " Answer in plain words, briefly, as a careful teacher would."}
    try:
        ask = (lambda content: s.client.chat.completions.create(  # noqa: E731
            model="smollm2", messages=[system, {"role": "user", "content": content}], temperature=0,
            max_tokens=12).choices[0].message.content)
        mine = [f"Describe the colour of the {w} in one sentence." for w in
                ("sky", "sea", "grass", "sun", "snow", "night", "rust", "sand")]
        alone = [ask(p) for p in mine]
        others = [f"Write a line about the number {i}." for i in range(24)]
        order = mine + others
        random.Random(0).shuffle(order)
        with cf.ThreadPoolExecutor(16) as ex:
            got = dict(zip(order, ex.map(ask, order)))
        assert [got[p] for p in mine] == alone
        assert s.metrics()["strata_cache_hits_total"] > 0  # the cache was used
        # clients that hang up mid-stream: their slots come free, nothing queues
        for _ in range(4):
            with s.http.stream("POST", "/v1/completions",
                               json={"prompt": "Tell me a long story.", "max_tokens": 400, "stream": True}) as r:
                next(r.iter_lines())
        deadline = time.time() + 20
        while s.metrics()["strata_busy_slots"] > 0 and time.time() < deadline:
            time.sleep(0.2)
        m = s.metrics()
        assert m["strata_busy_slots"] == 0 and m["strata_queue_length"] == 0
    finally:
        s.stop()


def test_chat_template_kwargs(server):
    """llama-server's and vLLM's chat_template_kwargs: enable_thinking reaches the template
    (SmolLM2's has no switch: the answer is the same), a wrong type or a variable the
    server sets is a 400 naming it."""
    plain = chat(server, max_tokens=6).choices[0].message.content
    assert chat(server, max_tokens=6, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                ).choices[0].message.content == plain
    for kw, words in (({"enable_thinking": "no"}, "true or false"), ({"messages": []}, "may not set messages")):
        r = server.http.post("/v1/chat/completions", json={"messages": CHAT, "chat_template_kwargs": kw})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
