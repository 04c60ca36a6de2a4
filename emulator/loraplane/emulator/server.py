"""The emulator's HTTP API: the part of vLLM 0.32's OpenAI server that loraplane, its peers and benchmark clients
use, with vLLM's bodies, chunk shapes, status codes and error messages (Starlette + uvicorn)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplane.emulator.adapters import AdapterNotFound, ModelShapes, WorkerError, read_adapter
from loraplane.emulator.engine import Engine, LoadTicket, Request
from loraplane.emulator.loop import EngineLoop
from loraplane.emulator.lora_cache import Lora
from loraplane.emulator.metrics import CONTENT_TYPE, render
from loraplane.emulator.tokens import chat_prompt, encode
from loraplane.emulator.tokens import render as render_tokens

#: the vLLM release whose API the emulator speaks
VLLM_VERSION = "0.32.0"
SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-emulator"
#: path prefixes ``--api-key`` guards (vLLM's ``AuthenticationMiddleware``)
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
#: vLLM's header that overrides a request's ``priority``
PRIORITY_HEADER = "x-vllm-priority"

# vLLM's ``sanitize_message``: no memory addresses, tracebacks or absolute paths in error messages
_SANITIZE = ((re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
             (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
             (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
             (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"))


def sanitize(message: str) -> str:
    """An error message as vLLM lets it out."""
    for pattern, replacement in _SANITIZE:
        message = pattern.sub(replacement, message)
    return message.strip()


class ApiError(Exception):
    """An error answered in vLLM's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": sanitize(self.message), "type": self.err_type, "param": self.param,
                          "code": self.status}}
        return JSONResponse(body, status_code=self.status)


def _validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """FastAPI's request validation error as vLLM words it (type ``Bad Request``, ``param`` the field)."""

    def summary(value: Any) -> Any:
        if isinstance(value, list | tuple | dict | set):
            return f"<{type(value).__name__} of {len(value)} items>"
        return value if isinstance(value, str) else str(value)

    lines = []
    for err in errors:
        shown = {k: v for k, v in err.items() if k != "url"}
        shown["loc"] = ".".join(str(p) for p in shown["loc"])
        if "input" in shown:
            shown["input"] = summary(shown["input"])
        if "ctx" in shown:
            shown["ctx"] = {k: str(v) for k, v in shown["ctx"].items()}
        lines.append(f"  {shown}")
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(lines)
    return ApiError(400, message, "Bad Request", ".".join(map(str, errors[0]["loc"])))


# --- bodies: the fields of vLLM's request models the emulator uses (others are accepted and ignored) -----------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = None


class _Generation(_Body):
    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    return_token_ids: bool | None = None


class CompletionBody(_Generation):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    max_tokens: int | None = 16


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatBody(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class LoadBody(_Body):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadBody(_Body):
    lora_name: str
    lora_int_id: int | None = None


class SageMakerLoadBody(_Body):
    name: str
    src: str


BodyT = TypeVar("BodyT", bound=BaseModel)


@dataclass(frozen=True)
class ApiConfig:
    """What the HTTP layer needs beyond the engine (vLLM's flags)."""

    #: ``--served-model-name`` (the first is the id answers carry), or ``--model``
    served_names: tuple[str, ...]
    #: ``--model`` as given (the base model card's ``root``)
    model: str
    max_model_len: int
    max_lora_rank: int
    #: bytes a rank-16 adapter costs to load
    adapter_bytes: int
    runtime_lora_updating: bool = False
    api_keys: tuple[str, ...] = ()
    prompt_tokens_details: bool = False
    shapes: ModelShapes | None = None


class EmulatorApi:
    """The route handlers over one engine and its loop."""

    def __init__(self, engine: Engine, loop: EngineLoop, config: ApiConfig,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.loop = loop
        self.config = config
        self.wall_clock = wall_clock
        self.start_time = wall_clock()
        #: vLLM's ``lora_id_counter``: every load that passes the checks, and every unknown model name (its resolver
        #: lookup), takes the next int id
        self.lora_ids = 0
        self._name_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    @property
    def base_model(self) -> str:
        return self.config.served_names[0]

    # --- generation -----------------------------------------------------------------------------------------------
    async def completions(self, http: HttpRequest) -> Response | _Answer:
        body = await _parse(http, CompletionBody)
        lora = self._model(body.model)
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ApiError(400, "batched prompts are not emulated: send one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                           param="prompt")
        ids: list[int] = encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self._submit(http, body, ids, lora, body.max_tokens, chat=False)

    async def chat_completions(self, http: HttpRequest) -> Response | _Answer:
        body = await _parse(http, ChatBody)
        lora = self._model(body.model)
        ids = encode(chat_prompt([(m.role, m.text()) for m in body.messages]))
        return self._submit(http, body, ids, lora, body.max_completion_tokens or body.max_tokens, chat=True)

    def _model(self, name: str | None) -> Lora | None:
        """The adapter ``name`` asks for (None: the base model); 404 for names vLLM does not serve."""
        if not name or name in self.config.served_names:
            return None
        lora = self.engine.registered.get(name)
        if lora is not None:
            return lora
        if self.config.runtime_lora_updating:
            self.lora_ids += 1  # vLLM asks its (here: no) resolvers, which takes an int id
        raise ApiError(404, f"The model `{name}` does not exist. Valid aliases: "
                       f"{', '.join(self.config.served_names)}.", "NotFoundError", "model")

    def _max_tokens(self, asked: int | None, prompt_len: int) -> int:
        """vLLM's checks and ``get_max_tokens``: at most what the context leaves."""
        limit = self.config.max_model_len
        if asked is not None and asked > limit:
            raise ApiError(400, f"max_tokens={asked} cannot be greater than max_model_len={limit}. Please request "
                           f"fewer output tokens. (parameter=max_tokens, value={asked})", param="max_tokens")
        if prompt_len > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                           f"contains {prompt_len} input tokens, which exceeds this limit even without any output "
                           f"tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
                           f"value={prompt_len})", param="input_tokens")
        tokens = limit - prompt_len if asked is None else min(asked, limit - prompt_len)
        if tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {tokens}. (parameter=max_tokens, value={tokens})",
                           param="max_tokens")
        return tokens

    def _submit(self, http: HttpRequest, body: _Generation, ids: list[int], lora: Lora | None,
                asked_tokens: int | None, chat: bool) -> _Answer:
        if body.n != 1:
            raise ApiError(400, f"n={body.n}: only n=1 is emulated", param="n")
        if any(not isinstance(t, int) or t < 0 or t >= 1 << 63 for t in ids):
            raise ApiError(400, "token ids must be non-negative 64-bit integers", param="prompt")
        max_tokens = self._max_tokens(asked_tokens, len(ids))
        priority = body.priority
        header = http.headers.get(PRIORITY_HEADER)
        if header is not None and re.fullmatch(r"[+-]?\d+", header.strip()):
            priority = int(header)
        updated = asyncio.Event()
        req = Request(f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(8)}", ids, max_tokens, lora,
                      lora.files.digest if lora is not None else self.base_model,
                      priority=priority if self.engine.config.priority_policy else 0, stream=bool(body.stream),
                      on_update=updated.set)
        self.engine.add_request(req, self.loop.clock())
        self.loop.poke()
        model = lora.name if lora is not None else self.base_model
        answer = _Generated(self, req, updated, body, model, chat, int(self.wall_clock()))
        return _Answer(answer.stream() if req.stream else answer.final(), streaming=req.stream,
                       on_disconnect=lambda: self._abort(req))

    def _abort(self, req: Request) -> None:
        self.engine.abort(req, self.loop.clock())
        self.loop.poke()

    # --- models, health, metrics ----------------------------------------------------------------------------------
    async def models(self, http: HttpRequest) -> Response:
        created = int(self.wall_clock())

        def card(model_id: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
            permission = {"id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission", "created": created,
                          "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                          "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                          "organization": "*", "group": None, "is_blocking": False}
            return {"id": model_id, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                    "parent": parent, "max_model_len": max_model_len, "permission": [permission]}

        data = [card(name, self.config.model, None, self.config.max_model_len) for name in self.config.served_names]
        data += [card(lora.name, lora.path, self.base_model, None) for lora in self.engine.registered.values()]
        return _json({"object": "list", "data": data})

    async def health(self, http: HttpRequest) -> Response:
        return Response(status_code=200)

    async def version(self, http: HttpRequest) -> Response:
        return _json({"version": VLLM_VERSION})

    async def metrics(self, http: HttpRequest) -> Response:
        now = self.loop.clock()
        self.engine.advance(now)
        offset = self.wall_clock() - now
        text = render(self.engine, self.base_model, self.start_time, lambda t: t + offset)
        return Response(text, headers={"content-type": CONTENT_TYPE})

    # --- the dynamic LoRA API -------------------------------------------------------------------------------------
    async def load_lora_adapter(self, http: HttpRequest) -> Response:
        body = await _parse(http, LoadBody)
        await self.load(body.lora_name, body.lora_path, body.load_inplace)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, http: HttpRequest) -> Response:
        body = await _parse(http, UnloadBody)
        self.unload(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def sagemaker_register(self, http: HttpRequest) -> Response:
        """SageMaker's ``POST /adapters`` (vLLM serves it whenever runtime updating is on, outside ``/v1``)."""
        try:
            body = SageMakerLoadBody.model_validate(orjson.loads(await http.body()))
        except (orjson.JSONDecodeError, ValidationError) as exc:
            raise ApiError(400, str(exc), "Bad Request") from None
        await self.load(body.name, body.src, False)
        return Response(f"Adapter {body.name} registered")

    async def sagemaker_unregister(self, http: HttpRequest) -> Response:
        name = http.path_params["name"]
        self.unload(name)
        return Response(f"Adapter {name} unregistered")

    async def load(self, name: str, path: str, inplace: bool) -> Lora:
        """vLLM's ``load_lora_adapter``: checks, the next int id, the worker's read and checks, then the load and
        activation between two engine steps (its time charged); registered once it succeeded."""
        async with self._name_locks[name]:
            if not name or not path:
                raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
            if name in self.config.served_names:
                raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.",
                               "InvalidUserInput")
            previous = self.engine.registered.get(name)
            if previous is not None and not inplace:
                raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
            if previous is not None:
                int_id = previous.int_id
            else:
                self.lora_ids += 1
                int_id = self.lora_ids
            try:
                files = read_adapter(name, path, self.config.max_lora_rank, self.config.shapes)
            except AdapterNotFound as exc:
                raise ApiError(404, str(exc), "NotFoundError") from None
            except WorkerError as exc:
                raise ApiError(500, str(exc), "InternalServerError") from None
            lora = Lora(name, int_id, path, files, self.config.adapter_bytes * files.rank // 16, load_inplace=inplace)
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def replied() -> None:
                if not done.done():
                    done.set_result(None)

            self.engine.load(LoadTicket(lora, files.slot_error, on_done=replied), self.loop.clock())
            self.loop.poke()
            await done
            if files.slot_error is not None:
                raise ApiError(500, str(WorkerError(files.slot_error)), "InternalServerError")
            self.engine.registered[name] = lora
            return lora

    def unload(self, name: str) -> None:
        """vLLM's ``unload_lora_adapter``: only the name goes; the copy stays in the worker's caches."""
        if not name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if self.engine.registered.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")


class _Generated:
    """One request's answer: vLLM's completion or chat body, or its stream of chunks."""

    def __init__(self, api: EmulatorApi, req: Request, updated: asyncio.Event, body: _Generation, model: str,
                 chat: bool, created: int) -> None:
        self.api, self.req, self.updated, self.body = api, req, updated, body
        self.model, self.chat, self.created = model, chat, created
        self.token_ids = bool(body.return_token_ids)

    def _usage(self, streaming: bool) -> dict[str, Any]:
        req = self.req
        usage: dict[str, Any] = {"prompt_tokens": len(req.prompt), "total_tokens": len(req.prompt) + req.output,
                                 "completion_tokens": req.output}
        details = self.api.config.prompt_tokens_details
        if streaming:
            if details:
                usage["prompt_tokens_details"] = {"cached_tokens": req.cached_tokens}
            return usage
        usage["prompt_tokens_details"] = ({"cached_tokens": req.cached_tokens, "created_cache_tokens": None,
                                           "multimodal_tokens": None} if details else None)
        usage["completion_tokens_details"] = None
        return usage

    async def final(self) -> AsyncIterator[bytes]:
        """The whole answer once the request finished."""
        req = self.req
        while not req.finished:
            await self.updated.wait()
            self.updated.clear()
        ids = req.outputs.first(req.output)
        text = render_tokens(ids)
        base = {"id": req.request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model}
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                        "audio": None, "function_call": None, "reasoning": None},
                "logprobs": None, "finish_reason": req.finish_reason, "stop_reason": None,
                "token_ids": ids if self.token_ids else None, "routed_experts": None}
            extra: dict[str, Any] = {"prompt_logprobs": None,
                                     "prompt_token_ids": req.prompt if self.token_ids else None, "prompt_text": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": req.finish_reason,
                      "stop_reason": None, "token_ids": ids if self.token_ids else None, "prompt_logprobs": None,
                      "prompt_token_ids": req.prompt if self.token_ids else None, "routed_experts": None}
            extra = {}
        yield orjson.dumps({**base, "choices": [choice], "service_tier": None,
                            "system_fingerprint": SYSTEM_FINGERPRINT, "usage": self._usage(False), **extra,
                            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})

    async def stream(self) -> AsyncIterator[bytes]:
        """Server-sent events: a chunk when the first token is out, then one per delivery of coalesced tokens (the
        last with ``finish_reason``), the usage chunk when asked for, ``[DONE]``."""
        req, chat = self.req, self.chat
        base = {"id": req.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": self.created, "model": self.model}
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        sent = 0
        while True:
            await self.updated.wait()
            self.updated.clear()
            if req.delivered <= sent and not req.finished:
                continue
            ids = req.outputs.first(req.delivered)[sent:]
            finish = req.finish_reason if req.finished else None
            token_ids = ids if self.token_ids else None
            if chat:
                if sent == 0:
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}
                    yield _event({**base, "choices": [role], "prompt_token_ids": req.prompt if self.token_ids
                                  else None, "prompt_text": None})
                choice: dict[str, Any] = {"index": 0, "delta": {"content": render_tokens(ids)}, "logprobs": None,
                                          "finish_reason": finish}
                if finish is not None:
                    choice["stop_reason"] = None
                choice["token_ids"] = token_ids
            else:
                choice = {"index": 0, "text": render_tokens(ids), "logprobs": None, "finish_reason": finish,
                          "stop_reason": None, "prompt_token_ids": req.prompt if self.token_ids and sent == 0 else None,
                          "token_ids": token_ids}
            chunk: dict[str, Any] = {**base, "choices": [choice]}
            if finish is not None and not include_usage:
                chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
            yield _event(chunk)
            sent = req.delivered
            if req.finished:
                break
        if include_usage:
            yield _event({**base, "choices": [], "usage": self._usage(True), "system_fingerprint": SYSTEM_FINGERPRINT})
        yield b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


class _Answer:
    """An ASGI response that waits on the engine: one JSON body when the request finished, or a stream of events
    sent as tokens come. A client that goes away first aborts the request (vLLM frees its blocks and its place)."""

    def __init__(self, chunks: AsyncIterator[bytes], streaming: bool, on_disconnect: Callable[[], None]) -> None:
        self.chunks, self.streaming, self.on_disconnect = chunks, streaming, on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self._send(send))
        watching = asyncio.ensure_future(_disconnected(receive))
        done, _ = await asyncio.wait((sending, watching), return_when=asyncio.FIRST_COMPLETED)
        watching.cancel()
        if sending in done and not isinstance(sending.exception(), OSError):
            sending.result()  # sent (or a bug, raised)
            return
        sending.cancel()  # the client went away (OSError: while sending to it)
        self.on_disconnect()

    async def _send(self, send: Send) -> None:
        if self.streaming:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        async for body in self.chunks:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _parse(http: HttpRequest, model: type[BodyT]) -> BodyT:
    """The JSON body as ``model``; vLLM's 400 for bad JSON and wrong fields."""
    raw = await http.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        position = getattr(exc, "pos", 0)
        raise _validation_error([{"type": "json_invalid", "loc": ("body", position), "msg": "JSON decode error",
                                  "input": {}, "ctx": {"error": getattr(exc, "msg", str(exc))}}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in exc.errors()]
        raise _validation_error(errors) from None


def _guarded(handler: Callable[[HttpRequest], Awaitable[Any]]) -> Callable[[HttpRequest], Awaitable[Any]]:
    async def endpoint(http: HttpRequest) -> Any:
        try:
            return await handler(http)
        except ApiError as exc:
            return exc.response()

    return endpoint


def _api_key(app: ASGIApp, keys: tuple[str, ...]) -> ASGIApp:
    """vLLM's ``AuthenticationMiddleware``: ``/v1`` (and vLLM's other API prefixes) need ``Authorization: Bearer
    <key>``; ``/health``, ``/metrics``, ``/version`` and the SageMaker routes do not."""
    digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    def authorized(scope: Scope) -> bool:
        value = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        return any([secrets.compare_digest(digest, known) for known in digests])

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(GUARDED_PREFIXES)
                and not authorized(scope)):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await app(scope, receive, send)

    return guarded


async def _http_error(http: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)


def build_app(api: EmulatorApi, startup: Callable[[], Awaitable[None]] | None = None) -> ASGIApp:
    """The ASGI app; the engine loop runs for the app's lifespan (``startup`` runs once it does)."""
    routes = [
        Route("/v1/completions", _guarded(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(api.chat_completions), methods=["POST"]),
        Route("/v1/models", _guarded(api.models), methods=["GET"]),
        Route("/health", _guarded(api.health), methods=["GET"]),
        Route("/version", _guarded(api.version), methods=["GET"]),
        Route("/metrics", _guarded(api.metrics), methods=["GET"]),
    ]
    if api.config.runtime_lora_updating:
        routes += [
            Route("/v1/load_lora_adapter", _guarded(api.load_lora_adapter), methods=["POST"]),
            Route("/v1/unload_lora_adapter", _guarded(api.unload_lora_adapter), methods=["POST"]),
            Route("/adapters", _guarded(api.sagemaker_register), methods=["POST"]),
            Route("/adapters/{name:path}", _guarded(api.sagemaker_unregister), methods=["DELETE"]),
        ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runner = asyncio.ensure_future(api.loop.run())
        try:
            if startup is not None:
                await startup()
            yield
        finally:
            runner.cancel()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    return _api_key(app, api.config.api_keys) if api.config.api_keys else app
