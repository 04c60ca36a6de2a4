"""The HTTP API: OpenAI/vLLM-compatible completions, models, health, dynamic LoRA loading, admin, metrics."""

from __future__ import annotations

import hmac
import ipaddress
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from loraplane.api import ADAPTER_DIGEST_HEADER, SERVED_ADAPTER_HEADER
from loraplane.engine.adapters import AdapterNotFoundError, AdapterRejectedError
from loraplane.engine.core import AdapterBusyError, Engine, Request, RequestError, SamplingParams, TokenEvent
from loraplane.engine.tiers import AdapterState
from loraplane.engine.tokenizer import chat_prompt

#: Largest request body accepted (a prompt of token ids at the default limits is far smaller).
MAX_BODY_BYTES = 4 << 20

#: Headers a proxy adds: an admin call carrying one came through a proxy, so loopback says nothing about the caller.
_PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip", "x-envoy-external-address")


@dataclass
class ServerConfig:
    """What the HTTP layer needs beyond the engine."""

    served_model_name: str
    base_model_digest: str
    adapter_root: Path | None = None
    allow_runtime_lora_updating: bool = False
    admin_token: str | None = None
    max_model_len: int = 512


class ApiError(Exception):
    """An error answered in vLLM's JSON shape."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def response(self) -> JSONResponse:
        """``{"error": {"message", "type", "param", "code"}}`` with HTTP status = code."""
        body = {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status)


def _bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _SamplingBody(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    priority: int = 0
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False
    logprobs: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    def sampling(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.max_tokens or self.max_completion_tokens or 16, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, priority=self.priority,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBody(_SamplingBody):
    """``POST /v1/completions``: ``prompt`` is text or token ids (or a list holding exactly one of those)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class ChatMessage(_Body):
    """One chat message; content parts of type ``text`` are joined."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatBody(_SamplingBody):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)


class LoadLoraBody(_Body):
    """vLLM's ``LoadLoRAAdapterRequest``."""

    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False


class UnloadLoraBody(_Body):
    """vLLM's ``UnloadLoRAAdapterRequest``."""

    lora_name: str | None = None
    lora_int_id: int | None = None


BodyT = TypeVar("BodyT", bound=BaseModel)


class PriorityBody(_Body):
    """``POST /admin/adapters/{name}/priority``: the tenant priority keep-score uses."""

    priority: int = Field(ge=-100, le=100)


async def _read_body(request: HttpRequest) -> bytes:
    """The body, refused with 413 past :data:`MAX_BODY_BYTES` (checked while streaming it in, not after)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", "BadRequestError")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", "BadRequestError")
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: HttpRequest, model: type[BodyT]) -> BodyT:
    try:
        raw = orjson.loads(await _read_body(request))
    except orjson.JSONDecodeError as exc:
        raise _bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise _bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise _bad_request(f"{where}: {first['msg']}", where or None) from None


class EngineApi:
    """Starlette handlers over one :class:`Engine`."""

    def __init__(self, engine: Engine, config: ServerConfig, wall_clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.config = config
        self.wall_clock = wall_clock

    # --- helpers ------------------------------------------------------------------------------------------------
    def _resolve_model(self, name: str | None) -> AdapterState | None:
        if name is None or name == self.config.served_model_name:
            return None
        adapter = self.engine.tiers.registered.get(name)
        if adapter is None:
            raise ApiError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
        return adapter

    def _identity_headers(self, adapter: AdapterState | None) -> dict[str, str]:
        if adapter is None:
            return {SERVED_ADAPTER_HEADER: self.config.served_model_name, ADAPTER_DIGEST_HEADER: self.config.base_model_digest}
        return {SERVED_ADAPTER_HEADER: adapter.name, ADAPTER_DIGEST_HEADER: adapter.digest}

    def _check_admin(self, request: HttpRequest) -> None:
        """With an admin token: only ``Authorization: Bearer <token>``. Without one: only a loopback caller that
        came through no proxy (a unix socket has no peer address and counts as local). Else 403."""
        token = self.config.admin_token
        if token:
            auth = request.headers.get("authorization", "")
            if auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].encode(), token.encode()):
                return
            raise ApiError(403, "admin endpoints need the admin token", "PermissionDeniedError")
        host = request.client.host if request.client else ""
        try:
            local = ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = request.client is None or not host  # a unix socket: no peer address
        if local and not any(h in request.headers for h in _PROXY_HEADERS):
            return
        raise ApiError(403, "admin endpoints need a loopback caller or the admin token", "PermissionDeniedError")

    async def _submit(self, body: _SamplingBody, prompt_ids: list[int]) -> tuple[Request, AdapterState | None]:
        adapter = self._resolve_model(body.model)
        if body.logprobs not in (None, False):
            raise _bad_request("logprobs are not supported by this engine", "logprobs")
        try:
            return self.engine.submit(prompt_ids, body.sampling(), adapter), adapter
        except RequestError as exc:
            raise _bad_request(str(exc)) from None

    def _served_name(self, adapter: AdapterState | None) -> str:
        return self.config.served_model_name if adapter is None else adapter.name

    # --- completions --------------------------------------------------------------------------------------------
    async def completions(self, request: HttpRequest) -> Response:
        body = await _parse(request, CompletionBody)
        if body.echo:
            raise _bad_request("echo is not supported by this engine", "echo")
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise _bad_request("batched prompts are not supported: send one prompt per request", "prompt")
            prompt = prompt[0]
        prompt_ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        req, adapter = await self._submit(body, prompt_ids)
        return await self._respond(req, adapter, body, "text_completion")

    async def chat_completions(self, request: HttpRequest) -> Response:
        body = await _parse(request, ChatBody)
        prompt = chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages])
        req, adapter = await self._submit(body, self.engine.tokenizer.encode(prompt))
        return await self._respond(req, adapter, body, "chat.completion")

    async def _respond(self, req: Request, adapter: AdapterState | None, body: _SamplingBody, kind: str) -> Response:
        headers = self._identity_headers(adapter)
        created = int(self.wall_clock())
        model = self._served_name(adapter)
        if body.stream:
            chunks = self._stream_chunks(req, model, created, kind, body)
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
        finish = None
        error = ""
        async for event in self.engine.stream(req):
            finish, error = event.finish_reason, event.text if event.finish_reason == "error" else error
        if finish == "error":
            raise ApiError(500, error, "InternalServerError")
        usage = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
                 "total_tokens": len(req.prompt_ids) + len(req.output_ids)}
        if kind == "chat.completion":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": req.text},
                                      "logprobs": None, "finish_reason": finish, "stop_reason": None}
        else:
            choice = {"index": 0, "text": req.text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        if body.return_token_ids:
            choice.update(prompt_token_ids=req.prompt_ids, token_ids=req.output_ids)
        payload = {"id": req.request_id, "object": kind, "created": created, "model": model,
                   "choices": [choice], "usage": usage}
        return Response(orjson.dumps(payload), media_type="application/json", headers=headers)

    async def _stream_chunks(self, req: Request, model: str, created: int, kind: str, body: _SamplingBody) -> AsyncIterator[bytes]:
        chat = kind == "chat.completion"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict[str, Any]) -> bytes:
            payload = {"id": req.request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
            return b"data: " + orjson.dumps(payload) + b"\n\n"

        def choice_of(event: TokenEvent, first: bool) -> dict[str, Any]:
            finish = event.finish_reason
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": event.text} if first else {"content": event.text}
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": event.text, "logprobs": None, "finish_reason": finish}
            if body.return_token_ids and event.token_id is not None:
                choice["token_ids"] = [event.token_id]
            return choice

        first = True
        async for event in self.engine.stream(req):
            if event.finish_reason == "error":
                err = {"error": {"message": event.text, "type": "InternalServerError", "param": None, "code": 500}}
                yield b"data: " + orjson.dumps(err) + b"\n\n"
                break
            if event.finish_reason is not None:
                yield chunk(choice_of(TokenEvent(None, "", event.finish_reason), first))
            else:
                yield chunk(choice_of(event, first))
            first = False
        if body.include_usage:
            usage = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
                     "total_tokens": len(req.prompt_ids) + len(req.output_ids)}
            payload = {"id": req.request_id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
            yield b"data: " + orjson.dumps(payload) + b"\n\n"
        yield b"data: [DONE]\n\n"

    # --- models, health, metrics --------------------------------------------------------------------------------
    async def models(self, request: HttpRequest) -> Response:
        created = int(self.wall_clock())
        base = self.config.served_model_name

        def card(model_id: str, parent: str | None, root: str) -> dict[str, Any]:
            return {"id": model_id, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                    "parent": parent, "max_model_len": self.config.max_model_len, "permission": []}

        data = [card(base, None, base)]
        data += [card(a.name, base, str(a.path)) for a in self.engine.tiers.registered.values()]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: HttpRequest) -> Response:
        return Response(status_code=200)

    async def metrics(self, request: HttpRequest) -> Response:
        return Response(self.engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- vLLM dynamic LoRA API ----------------------------------------------------------------------------------
    async def load_lora_adapter(self, request: HttpRequest) -> Response:
        self._check_admin(request)
        body = await _parse(request, LoadLoraBody)
        if not body.lora_name or not body.lora_path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        name = body.lora_name
        if name == self.config.served_model_name:
            raise ApiError(400, f"The lora adapter name '{name}' conflicts with the base model.", "InvalidUserInput", "lora_name")
        if name in self.engine.tiers.registered and not body.load_inplace:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                           "in place, set 'load_inplace' to True.", "InvalidUserInput")
        if self.config.adapter_root is None:
            raise ApiError(400, f"Failed to load LoRA adapter '{name}': dynamic loading is confined to --adapter-root, "
                           "and none is configured", "BadRequestError")
        try:
            await self.engine.add_adapter(name, body.lora_path, root=self.config.adapter_root)
        except AdapterNotFoundError as exc:
            raise ApiError(404, str(exc), "NotFoundError") from None
        except (AdapterRejectedError, OSError) as exc:
            raise ApiError(400, f"Failed to load LoRA adapter '{name}': {exc}", "BadRequestError") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: HttpRequest) -> Response:
        self._check_admin(request)
        body = await _parse(request, UnloadLoraBody)
        if not body.lora_name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        try:
            await self.engine.remove_adapter(body.lora_name)
        except KeyError:
            raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "NotFoundError") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # --- admin (tiers) ------------------------------------------------------------------------------------------
    async def admin_adapters(self, request: HttpRequest) -> Response:
        self._check_admin(request)
        tiers = self.engine.tiers
        return JSONResponse({
            "base_model": self.config.served_model_name,
            "base_model_digest": self.config.base_model_digest,
            "max_loras": tiers.max_loras,
            "max_cpu_loras": tiers.max_cpu_loras,
            "max_lora_rank": tiers.max_lora_rank,
            "eviction_policy": tiers.policy.name,
            "adapters": [a.residency().model_dump(mode="json") for a in tiers.registered.values()],
        })

    async def admin_action(self, request: HttpRequest) -> Response:
        self._check_admin(request)
        name, action = request.path_params["name"], request.path_params["action"]
        adapter = self.engine.tiers.registered.get(name)
        if adapter is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        tiers = self.engine.tiers
        if action == "pin" and not adapter.pinned and sum(a.pinned for a in tiers.registered.values()) + 1 >= tiers.max_loras:
            raise ApiError(409, f"pinning '{name}' would leave no GPU slot for other adapters "
                           f"(max_loras {tiers.max_loras})", "ConflictError")
        if action in ("activate", "pin"):
            if not await self.engine.activate(adapter):
                raise ApiError(409, f"no GPU slot can be freed for '{name}' (every slot is pinned or busy)", "ConflictError")
            if action == "pin":
                tiers.pin(adapter)
        elif action in ("offload", "demote"):
            try:
                await (self.engine.offload if action == "offload" else self.engine.demote)(adapter)
            except AdapterBusyError as exc:
                raise ApiError(409, str(exc), "ConflictError") from None
        elif action == "unpin":
            tiers.unpin(adapter)
        elif action == "priority":
            adapter.priority = (await _parse(request, PriorityBody)).priority
        else:
            raise ApiError(404, f"unknown admin action {action!r}", "NotFoundError")
        return JSONResponse(adapter.residency().model_dump(mode="json"))


def _guarded(handler: Callable[[HttpRequest], Any]) -> Callable[[HttpRequest], Any]:
    async def endpoint(request: HttpRequest) -> Response:
        try:
            response: Response = await handler(request)
        except ApiError as exc:
            return exc.response()
        return response

    return endpoint


def build_app(api: EngineApi, on_startup: Callable[[], Any] | None = None) -> Starlette:
    """The ASGI app. The engine's step loop runs for the app's lifespan."""

    routes = [
        Route("/v1/completions", _guarded(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(api.chat_completions), methods=["POST"]),
        Route("/v1/models", _guarded(api.models), methods=["GET"]),
        Route("/health", _guarded(api.health), methods=["GET"]),
        Route("/metrics", _guarded(api.metrics), methods=["GET"]),
        Route("/admin/adapters", _guarded(api.admin_adapters), methods=["GET"]),
        Route("/admin/adapters/{name:path}/{action}", _guarded(api.admin_action), methods=["POST"]),
    ]
    if api.config.allow_runtime_lora_updating:
        routes += [
            Route("/v1/load_lora_adapter", _guarded(api.load_lora_adapter), methods=["POST"]),
            Route("/v1/unload_lora_adapter", _guarded(api.unload_lora_adapter), methods=["POST"]),
        ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        api.engine.start()
        if on_startup is not None:
            await on_startup()
        try:
            yield
        finally:
            await api.engine.stop()

    return Starlette(routes=routes, lifespan=lifespan)
