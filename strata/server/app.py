"""HTTP routes, as llama-server and the OpenAI API name them.

POST /v1/chat/completions, /v1/completions (stream or not), /tokenize, /detokenize;
GET /v1/models, /health (503 while loading), /metrics (Prometheus text). Errors are HTTP
4xx/5xx {"error": {"message", "type", "code"}}: 400 for a bad request, 401 without the API
key (every route but /health, when the server has one), 413 for a body over the byte
bound, 503 with Retry-After for a full queue.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any

import jinja2
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata.runtime.sampling import SamplingParams
from strata.server.engine import Engine, QueueFull, Request
from strata.vision.images import PartError, flatten
from strata.tokenizer import TokenizerInputError
from strata.vision.preprocess import ImageError

log = logging.getLogger("strata.server")


class ApiError(Exception):
    def __init__(self, message: str, code: str = "invalid_request", status: int = 400, headers=None):
        super().__init__(message)
        self.message, self.code, self.status, self.headers = message, code, status, headers


def error(message: str, code: str, status: int = 400, headers=None) -> JSONResponse:
    kind = ("authentication_error" if status == 401 else "invalid_request_error" if status < 500
            else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}},
                        status_code=status, headers=headers)


class Guard:
    """ASGI middleware in front of every route: the API key (`Authorization: Bearer KEY`
    on every route but /health, compared in constant time) and the bound on a request's
    body bytes (413 before the body is parsed; a body without Content-Length is read up to
    the bound, then handed on)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.max = app, max_body_bytes
        self.key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.key and scope["path"] != "/health" and \
                not hmac.compare_digest(headers.get(b"authorization", b""), self.key):
            return await error("missing or wrong API key: send the header 'Authorization: Bearer KEY' "
                               "with the server's --api-key", "invalid_api_key", 401,
                               {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        too_big = error(f"the request body is over this server's bound of {self.max:,} bytes "
                        f"(--max-request-bytes)", "request_too_large", 413)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max:
            return await too_big(scope, receive, send)
        if scope["method"] in ("GET", "HEAD") or length is not None:
            return await self.app(scope, receive, send)
        body, more = b"", True  # no length given: read up to the bound
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.max:
                return await too_big(scope, receive, send)
        replayed = False

        async def again():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return await self.app(scope, again, send)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=0.8, ge=0)
    top_p: float = Field(default=0.95, gt=0, le=1)
    top_k: int = Field(default=40, ge=0)
    min_p: float = Field(default=0.05, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class ChatBody(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    # llama-server's and vLLM's field: {"enable_thinking": false} for Qwen3's templates
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionBody(_Sampling):
    prompt: str | list[int]


class TokenizeBody(BaseModel):
    content: str
    add_special: bool = False


class DetokenizeBody(BaseModel):
    tokens: list[int]


class State:
    def __init__(self):
        self.engine: Engine | None = None
        self.model_id = "strata"
        self.started = time.time()
        self.load_error: str | None = None


def create_app(model_id: str, default_max_tokens: int = 512, api_key: str | None = None,
               max_request_bytes: int = 8 << 20, max_prompt_tokens: int | None = None) -> FastAPI:
    """The routes; `app.state.strata.engine` is set once the model has loaded (until then
    /health says 503), or `load_error` if it failed. `api_key`: required of every request
    but /health (None: none); `max_request_bytes`: the bound on a request's body;
    `max_prompt_tokens`: the bound on a prompt (None: the engine's context size)."""
    app = FastAPI(title="strata")
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_request_bytes)
    st = State()
    st.model_id = model_id
    app.state.strata = st

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error(e.message, e.code, e.status, e.headers)

    @app.exception_handler(ImageError)
    async def _bad_image(_, e: ImageError):  # names the content part
        return error(str(e), "invalid_image")

    @app.exception_handler(PartError)
    async def _bad_part(_, e: PartError):  # names the content part
        return error(str(e), "invalid_messages")

    @app.exception_handler(TokenizerInputError)
    async def _bad_text(_, e: TokenizerInputError):  # text the tokenizer cannot take (a lone surrogate)
        return error(str(e), "invalid_text")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):  # a body that is not JSON, an unknown route
        return error(str(e.detail), "invalid_request" if e.status_code < 500 else "internal_error", e.status_code,
                     getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        parts = []
        for err in e.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return error("; ".join(parts) or "invalid request", "invalid_request")

    def engine() -> Engine:
        if st.engine is None:
            raise ApiError(st.load_error or "the model is still loading", "loading", 503,
                           {"Retry-After": "1"})
        return st.engine

    @app.get("/health")
    async def health():
        if st.engine is None:
            return JSONResponse({"status": "error", "message": st.load_error} if st.load_error else
                                {"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": st.model_id, "object": "model", "owned_by": "strata",
                                            "created": int(st.started)}]}

    @app.get("/metrics")
    async def metrics():
        lines = []
        if st.engine is not None:
            e = st.engine
            s = e.stats
            tps = s["generated_tokens"] / s["decode_seconds"] if s["decode_seconds"] else 0.0
            for name, kind, value, help_ in (
                ("prompt_tokens_total", "counter", s["prompt_tokens"], "prompt tokens received"),
                ("generated_tokens_total", "counter", s["generated_tokens"], "tokens generated"),
                ("requests_total", "counter", s["requests"], "requests started"),
                ("cached_prompt_tokens_total", "counter", s["cached_tokens"], "prompt tokens reused from the conversation cache"),
                ("cache_hits_total", "counter", e.prefix.hits, "prompts that reused a cached prefix"),
                ("cache_bytes", "gauge", e.prefix.nbytes, "bytes held by the conversation cache"),
                ("decode_tokens_per_second", "gauge", round(tps, 3), "generated tokens per second of engine time"),
                ("busy_slots", "gauge", e.busy_slots(), "slots with a request"),
                ("queue_length", "gauge", e.waiting.qsize(), "requests waiting for a slot"),
            ):
                lines += [f"# HELP strata_{name} {help_}", f"# TYPE strata_{name} {kind}", f"strata_{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        return {"tokens": engine().tok.encode(body.content, add_bos=body.add_special)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        e = engine()
        bad = [t for t in body.tokens if not 0 <= t < e.tok.vocab_size]
        if bad:
            raise ApiError(f"token ids out of range 0..{e.tok.vocab_size - 1}: {bad[:5]}")
        return {"content": e.tok.decode(body.tokens)}

    def params(body: _Sampling) -> SamplingParams:
        if body.model not in (None, "", st.model_id):
            raise ApiError(f"model {body.model!r} is not served here; this server serves {st.model_id!r}",
                           "model_not_found")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        n = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                              min_p=body.min_p, seed=body.seed, stop=stop,
                              max_tokens=default_max_tokens if n is None else n)

    async def run(http: HTTPRequest, prompt: list[int], sp: SamplingParams, body: _Sampling, chat: bool,
                  images=(), key: list[int] | None = None):
        e = engine()
        if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
            raise ApiError(f"the prompt has {len(prompt)} tokens; this server takes at most {max_prompt_tokens} "
                           f"(--max-prompt-tokens)", "prompt_too_long")
        if len(prompt) + sp.max_tokens > e.ctx_size:
            raise ApiError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({sp.max_tokens}) exceeds "
                           f"the context size ({e.ctx_size} tokens)", "context_length_exceeded")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = Request(prompt, sp, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                      images=list(images), key=key)
        try:
            e.submit(req)
        except QueueFull as ex:
            raise ApiError(f"server busy: {ex}; retry shortly", "queue_full", 503, {"Retry-After": "2"}) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage():
            details = {"cached_tokens": req.cached_tokens}
            if images:  # counted in prompt_tokens too
                details["image_tokens"] = sum(im.n_tokens for im in images)
            return {"prompt_tokens": len(prompt), "completion_tokens": len(req.tokens),
                    "total_tokens": len(prompt) + len(req.tokens), "prompt_tokens_details": details}

        if not body.stream:
            try:
                while True:
                    ev = await events.get()
                    if ev["type"] == "error":
                        raise ApiError(ev["message"], "internal_error", 500)
                    if ev["type"] == "done":
                        break
            except asyncio.CancelledError:
                req.cancelled = True
                raise
            choice = ({"index": 0, "message": {"role": "assistant", "content": req.text},
                       "finish_reason": req.finish_reason} if chat else
                      {"index": 0, "text": req.text, "finish_reason": req.finish_reason, "logprobs": None})
            return {"id": rid, "object": obj, "created": created, "model": st.model_id,
                    "choices": [choice], "usage": usage()}

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": delta_text} if delta_text else {})
                c = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            d = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                 "model": st.model_id, "choices": [c]}
            return f"data: {json.dumps(d)}\n\n"

        async def sse():
            try:
                if chat:
                    yield chunk(None, None, first=True)
                while True:
                    if await http.is_disconnected():
                        req.cancelled = True
                        return
                    try:
                        ev = await asyncio.wait_for(events.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        continue
                    if ev["type"] == "text":
                        yield chunk(ev["text"], None)
                    elif ev["type"] == "error":
                        yield f"data: {json.dumps({'error': {'message': ev['message'], 'type': 'server_error', 'code': 'internal_error'}})}\n\n"
                        return
                    else:
                        yield chunk(None, ev["finish_reason"])
                        if include_usage:
                            u = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                                 "model": st.model_id, "choices": [], "usage": usage()}
                            yield f"data: {json.dumps(u)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
            finally:  # the client went away, or the stream ended: free the slot at once
                if req.finish_reason is None:
                    req.cancelled = True

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HTTPRequest):
        sp = params(body)
        e = engine()
        for m in body.messages:
            if not isinstance(m.get("content", ""), (str, list)) or \
                    m.get("role") not in ("system", "user", "assistant", "tool"):
                raise ApiError("each message needs a role (system, user, assistant) and content: text, or a "
                               "list of text and image_url parts", "invalid_messages")
        messages, sources = flatten(body.messages)
        if sources and e.vision is None:
            raise ApiError(f"{sources[0][1]}: this server takes no images: it loaded no vision tower (serve a model "
                           f"with its mmproj file, --mmproj PATH, in one process)", "images_not_supported")
        # decoding and resizing is the request's own work, off the event loop
        images = [await asyncio.to_thread(e.vision.read, src, label, False) for src, label in sources]
        kw = dict(body.chat_template_kwargs or {})
        think = kw.pop("enable_thinking", None)
        if think is not None and not isinstance(think, bool):
            raise ApiError(f"chat_template_kwargs.enable_thinking must be true or false, got {think!r}",
                           "invalid_request")
        taken = sorted(set(kw) & {"messages", "add_generation_prompt", "bos_token", "eos_token"})
        if taken:
            raise ApiError(f"chat_template_kwargs may not set {', '.join(taken)}: the server sets them",
                           "invalid_request")
        try:
            text = e.tok.apply_chat_template(messages, enable_thinking=think, **kw)
        except jinja2.TemplateError as ex:  # the template refused these messages
            raise ApiError(f"the model's chat template refused these messages: {ex}", "invalid_messages") from None
        prompt = e.tok.encode(text)
        if images:
            prompt = e.vision.expand(prompt, images)
            return await run(http, prompt, sp, body, chat=True, images=images, key=e.vision.key(prompt, images))
        return await run(http, prompt, sp, body, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        sp = params(body)
        e = engine()
        prompt = e.tok.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if not prompt:
            raise ApiError("the prompt is empty", "empty_prompt")
        if any(not 0 <= t < e.tok.vocab_size for t in prompt):
            raise ApiError(f"prompt token ids must lie in 0..{e.tok.vocab_size - 1}", "invalid_prompt")
        return await run(http, prompt, sp, body, chat=False)

    return app
