"""`leantune vllm-serve`'s routes (Starlette) and what they share: the engine, its limits, the weight update in
progress, and the queue that hands every engine call to the thread that built the engine.

Each route parses its JSON body against a fixed schema (an object with exactly its fields, each checked: 400 naming
the field), after server_guard has checked everything in the request's head. Errors come back as {"error": message}:
400 for a request or update refused, 409 for an update that is not in progress, 500 (logged with its traceback) for
a fault of the server. A weight chunk is checked on a worker thread (not the event loop), and any failure of it
(a bad body, a refused tensor, a fault) discards its update.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import re
import threading
from dataclasses import dataclass
from urllib.parse import parse_qs

from safetensors import SafetensorError
from safetensors.torch import load
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from .served_weights import UnknownUpdateError, WeightUpdateError, WeightUpdates
from .server_guard import JSON, SAFETENSORS
from .server_requests import GenerationLimits, RequestError, checked_prompts, checked_sampling, logprobs_to_json

logger = logging.getLogger("leantune.generation")

UPDATE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHUNK_PATH = "/update_weights/chunk"
# path -> (method, the Content-Type of its body, or None: no body)
ROUTES = {
    "/health": ("GET", None),
    "/generate": ("POST", JSON),
    "/update_weights/begin": ("POST", JSON),
    CHUNK_PATH: ("POST", SAFETENSORS),
    "/update_weights/commit": ("POST", JSON),
    "/update_weights/abort": ("POST", JSON),
    "/close": ("POST", JSON),
}


@dataclass(frozen=True)
class ServedLimits:
    max_request_bytes: int
    generation: GenerationLimits


class GenerationServer:
    """The state the routes share; `engine_jobs` is drained by `serve` on the engine's thread."""

    def __init__(self, engine, limits: ServedLimits, update_expiry: float):
        self.engine = engine
        self.limits = limits
        self.updates = WeightUpdates(engine.expected_weights, update_expiry)
        self.weight_updates = 0
        self.engine_jobs: queue.Queue = queue.Queue()
        self.stopping = threading.Event()

    async def on_engine_thread(self, fn, *args):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.engine_jobs.put((future, fn, args))
        return await asyncio.wrap_future(future)

    def run_engine_jobs(self, poll_seconds: float = 0.1) -> None:
        """Run queued engine calls one at a time until `stopping`; expire a stale weight update between them."""
        while not self.stopping.is_set():
            self.updates.expire()
            try:
                future, fn, args = self.engine_jobs.get(timeout=poll_seconds)
            except queue.Empty:
                continue
            if not future.set_running_or_notify_cancel():
                continue  # its request went away
            try:
                future.set_result(fn(*args))
            except Exception as error:  # handed back to the request that asked
                future.set_exception(error)

    def abort_refused_chunk(self, scope) -> None:
        """server_guard's hook: a chunk refused before it was read (413, stalled, cut short) ends its update."""
        if scope["path"] == CHUNK_PATH:
            update_id = parse_qs(scope["query_string"].decode("latin-1")).get("update_id", [None])[0]
            if update_id:
                self.updates.abort(update_id, reason=f"a chunk of it was refused ({scope['path']})")

    def router(self) -> Router:
        return Router([
            Route("/health", _answering(self.health), methods=["GET"]),
            Route("/generate", _answering(self.generate), methods=["POST"]),
            Route("/update_weights/begin", _answering(self.begin_update), methods=["POST"]),
            Route(CHUNK_PATH, _answering(self.update_chunk), methods=["POST"]),
            Route("/update_weights/commit", _answering(self.commit_update), methods=["POST"]),
            Route("/update_weights/abort", _answering(self.abort_update), methods=["POST"]),
            Route("/close", _answering(self.close), methods=["POST"]),
        ], redirect_slashes=False)

    async def health(self, request: Request) -> dict:
        engine, limits = self.engine, self.limits
        return {"status": "ok", "engine": engine.name, "model": engine.model_path, "dtype": engine.dtype,
                "max_request_bytes": limits.max_request_bytes, "max_prompts": limits.generation.max_prompts,
                "max_new_tokens": limits.generation.max_new_tokens, "weight_updates": self.weight_updates}

    async def generate(self, request: Request) -> dict:
        body = await _json_object(request, "/generate", {"prompts", "sampling"})
        limits = self.limits.generation
        prompts = checked_prompts(body.get("prompts"), limits)
        sampling = checked_sampling(body.get("sampling"), limits, max((len(p) for p in prompts), default=0))
        completions = await self.on_engine_thread(self.engine.generate, prompts, sampling)
        return {"completions": [list(ids) for ids in completions],
                "logprobs": logprobs_to_json(getattr(completions, "logprobs", None))}

    async def begin_update(self, request: Request) -> dict:
        body = await _json_object(request, "/update_weights/begin", {"update_id"}, required={"update_id"})
        update_id = _update_id(body["update_id"])
        self.updates.begin(update_id)
        return {"update_id": update_id}

    async def update_chunk(self, request: Request) -> dict:
        update_id = _update_id(request.query_params.get("update_id"))
        body = await request.body()
        try:
            return {"loaded": await run_in_threadpool(self._stage, update_id, body)}
        except UnknownUpdateError:
            raise  # not this update's chunk: the one in progress goes on
        except Exception as error:
            self.updates.abort(update_id, reason=f"a chunk failed ({type(error).__name__})")
            raise

    def _stage(self, update_id: str, body: bytes) -> int:
        if update_id != self.updates.in_progress:
            raise UnknownUpdateError(f"weight update {update_id!r} is not in progress (never begun, ended, "
                                     "discarded, replaced or expired); begin a new one")
        try:
            tensors = load(body)
        except SafetensorError as error:
            raise WeightUpdateError(f"the body is not a safetensors file ({error}); the update is discarded, "
                                    "nothing of it was applied") from None
        return self.updates.add(update_id, tensors)

    async def commit_update(self, request: Request) -> dict:
        body = await _json_object(request, "/update_weights/commit", {"update_id", "names", "count"},
                                  required={"update_id", "names", "count"})
        tensors = self.updates.commit(_update_id(body["update_id"]), body["names"], body["count"])
        await self.on_engine_thread(self.engine.apply_weights, tensors)
        self.weight_updates += 1
        return {"updates": self.weight_updates}

    async def abort_update(self, request: Request) -> dict:
        body = await _json_object(request, "/update_weights/abort", {"update_id"}, required={"update_id"})
        return {"aborted": self.updates.abort(_update_id(body["update_id"]), reason="the client aborted it")}

    async def close(self, request: Request) -> Response:
        await _json_object(request, "/close", set())
        return JSONResponse({"status": "closing"}, background=BackgroundTask(self.stopping.set))


def _answering(handler):
    """A route: the handler's dict as JSON, or its error as {"error": ...} with the status it deserves."""
    async def endpoint(request: Request) -> Response:
        try:
            answer = await handler(request)
        except UnknownUpdateError as error:
            return _error(409, error)
        except (KeyError, ValueError, TypeError) as error:  # RequestError and WeightUpdateError among them
            return _error(400, error)
        except Exception as error:  # the server keeps serving; the client gets the reason
            logger.exception("vllm-serve: %s failed", request.url.path)
            return _error(500, error)
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    return endpoint


def _error(status: int, error: Exception) -> JSONResponse:
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return JSONResponse({"error": f"{type(error).__name__}: {text}"}, status_code=status)


async def _json_object(request: Request, route: str, fields: set[str], required: set[str] = frozenset()) -> dict:
    """The body as a JSON object with only `fields` (and all of `required`), or RequestError."""
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise RequestError(f"{route}: the body is not JSON") from None
    if not isinstance(body, dict) or set(body) - fields or required - set(body):
        quoted = [repr(name) for name in sorted(fields)]
        names = ", ".join(quoted[:-1]) + " and " + quoted[-1] if len(quoted) > 1 else "".join(quoted) or "no fields"
        raise RequestError(f"a {route} request is an object with {names} only"
                           + (f" (required: {', '.join(sorted(required))})" if required else ""))
    return body


def _update_id(value) -> str:
    if not isinstance(value, str) or not UPDATE_ID.fullmatch(value):
        raise RequestError(f"update_id: 1 to 64 letters, digits, '-' or '_', got {value!r}")
    return value
