"""The trainer's side of `leantune vllm-serve` (`use_vllm=True, vllm_mode="server"`): generation and weight sync
over HTTP (the protocol is in `vllm_server`).

Each process posts its own prompts. The weight sync is one update transaction: it begins an update under a new id,
streams `policy_weights_for_sync` from the main process as safetensors chunks of bounded size (cast to the server's
dtype) tagged with that id, then commits it with the names sent and their count (the server applies it whole and
resets its prefix cache). On any failure (an error answer, a timeout, an exception while gathering the weights, an
interrupt) it aborts the update, never commits it, and raises. Under ZeRO-3 every process takes part in the
gathering, and all wait for the update to land before any generates again. The server never sleeps, so `sleep` and
`wake_up` do nothing.

Every request carries the server's token (`LEANTUNE_VLLM_SERVER_TOKEN`, else for a loopback URL the token file the
server wrote; server_access), goes direct for a loopback or `no_proxy` host, must be answered whole within
`vllm_server_request_timeout` seconds (a deadline over connect, send and every read: server_transport; past it, a
VLLMServerError naming the server), and is sent again while the server answers 503 (busy) or closes the connection
before it has the whole request (its 503 to a big body), within that time.

Verified on CPU (tests/generation/test_vllm_server.py) against the server's transformers engine.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from urllib.parse import urlparse

import torch
from safetensors.torch import save

from .sampling import Completions, SamplingSettings, cut_completion
from .server_access import authorization_header
from .server_requests import logprobs_from_json, sampling_to_json
from .server_transport import ClosedWhileSending, DeadlinePassed, request
from .weight_sync import base_model_name_or_path, policy_weights_for_sync
from .zero3 import is_zero3

logger = logging.getLogger("leantune.generation")

DEFAULT_CHUNK_BYTES = 256 * 2**20
DEFAULT_REQUEST_TIMEOUT = 1800.0  # a long generation round (many prompts, long completions) must fit in it
BUSY_RETRY_SECONDS = 0.5
ABORT_SECONDS = 10.0


class VLLMServerError(RuntimeError):
    """The server answered with an error (`status`: its HTTP status), or did not answer (`status` None)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class VLLMServerClient:
    """HTTP calls to a `leantune vllm-serve` server."""

    def __init__(self, base_url: str, request_timeout: float = DEFAULT_REQUEST_TIMEOUT, token: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.request_timeout = request_timeout
        self.token = token  # None: the variable, else a loopback server's token file (server_access)
        self.server_info: dict = {}

    def wait_until_up(self, timeout: float, start_command: str | None = None) -> dict:
        """Poll GET /health until the server answers, for at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                self.server_info = self._call("GET", "/health", timeout=max(0.1, min(5.0, remaining)))
                return self.server_info
            except (OSError, VLLMServerError) as error:
                if getattr(error, "status", None) is not None:
                    raise  # it answered, with an error (a wrong token, say)
                if time.monotonic() + 1.0 > deadline:
                    hint = f" Start one with: {start_command}" if start_command else ""
                    raise VLLMServerError(f"No leantune vLLM server answered at {self.base_url}/health within "
                                          f"{timeout:g} s ({_reason(error)}).{hint}") from None
                time.sleep(1.0)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings) -> Completions:
        if not prompt_ids:
            return Completions([], [] if sampling.logprobs else None)
        answer = self._call("POST", "/generate", {"prompts": [list(map(int, ids)) for ids in prompt_ids],
                                                  "sampling": sampling_to_json(sampling)})
        completions = answer["completions"]
        if len(completions) != len(prompt_ids):
            raise VLLMServerError(f"{self.base_url} returned {len(completions)} completions for "
                                  f"{len(prompt_ids)} prompts.")
        logprobs = logprobs_from_json(answer.get("logprobs")) if sampling.logprobs else None
        if sampling.logprobs and logprobs is None:
            raise VLLMServerError(f"{self.base_url} returned no sampling log-probs (a server older than this "
                                  f"client?); restart it with this leantune's `leantune vllm-serve`.")
        ids, kept_logprobs = [], []
        for i, tokens in enumerate(completions):
            kept, token_logprobs = cut_completion(tokens, None if logprobs is None else logprobs[i], sampling)
            ids.append(kept)
            kept_logprobs.append(token_logprobs)
        return Completions(ids, kept_logprobs if sampling.logprobs else None)

    def update_weights(self, named_tensors, dtype: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
        """Send `(name, tensor)` pairs as one update, in safetensors chunks of about `chunk_bytes` (a bigger tensor
        goes alone); the number of tensors applied. Any failure aborts the update (nothing of it applied)."""
        update_id = uuid.uuid4().hex
        self._call("POST", "/update_weights/begin", {"update_id": update_id})
        names: list[str] = []
        try:
            for chunk in _chunks(named_tensors, getattr(torch, dtype) if dtype else None, chunk_bytes):
                self._call("POST", f"/update_weights/chunk?update_id={update_id}", data=save(chunk),
                           content_type="application/octet-stream")
                names.extend(chunk)
            self._call("POST", "/update_weights/commit", {"update_id": update_id, "names": names,
                                                           "count": len(names)})
        except BaseException:
            self.abort_update(update_id)
            raise
        return len(names)

    def abort_update(self, update_id: str) -> None:
        """Discard an update on the server (best effort: a server that is gone expires it on its own)."""
        try:
            self._call("POST", "/update_weights/abort", {"update_id": update_id},
                       timeout=min(ABORT_SECONDS, self.request_timeout))
        except (OSError, VLLMServerError) as error:
            logger.warning("Could not abort weight update %s on %s (%s); the server discards it when it expires.",
                           update_id, self.base_url, error)

    def close_server(self) -> None:
        self._call("POST", "/close", {})

    def _authorization(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else authorization_header(self.base_url)

    def _post_bytes(self, path: str, data: bytes) -> dict:
        return self._call("POST", path, data=data, content_type="application/octet-stream")

    def _call(self, method: str, path: str, payload: dict | None = None, data: bytes | None = None,
              content_type: str = "application/json", timeout: float | None = None) -> dict:
        if payload is not None:
            data = json.dumps(payload).encode()
        headers = {"Content-Type": content_type} if data is not None else {}
        timeout = timeout or self.request_timeout
        deadline = time.monotonic() + timeout
        url = self.base_url + path
        while True:
            try:
                status, body = request(method, url, data, {**headers, **self._authorization()},
                                       max(0.001, deadline - time.monotonic()))
            except DeadlinePassed:
                raise VLLMServerError(_timeout_message(method, url, timeout)) from None
            except ClosedWhileSending as error:  # the server's 503 before reading the body: nothing was done
                status, body = 503, json.dumps({"error": f"busy: closed while the request was sent ({error})"}).encode()
            if status == 503 and time.monotonic() + BUSY_RETRY_SECONDS < deadline:
                time.sleep(BUSY_RETRY_SECONDS)  # busy: all its request slots are taken
                continue
            if status >= 400:
                raise VLLMServerError(f"{method} {url} failed with HTTP {status}: {_server_message(body)}",
                                      status=status)
            return json.loads(body or b"{}")


class VLLMServerBackend:
    """A `leantune vllm-serve` server as the trainer's generation backend."""

    name = "vllm-server"

    def __init__(self, args, model, tokenizer, accelerator):
        self.accelerator = accelerator
        self.chunk_bytes = DEFAULT_CHUNK_BYTES
        self.needs_sync = True  # the server holds its checkpoint until the first sync
        self.client = VLLMServerClient(server_url(args), request_timeout=float(
            getattr(args, "vllm_server_request_timeout", None) or DEFAULT_REQUEST_TIMEOUT))
        source = base_model_name_or_path(model, accelerator) or "PATH"
        command = f"leantune vllm-serve --model {source} --port {_port(self.client.base_url, args)}"
        info = self.client.wait_until_up(args.vllm_server_timeout, start_command=command)
        logger.info("vLLM server at %s: %s engine, model %s, %s.", self.client.base_url, info.get("engine"),
                    info.get("model"), info.get("dtype"))

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSettings) -> Completions:
        return self.client.generate(prompt_ids, sampling)

    def sync_weights(self, model) -> None:
        """The main process sends the weights; with ZeRO-3 every process joins the per-module gathering."""
        main = self.accelerator is None or self.accelerator.is_main_process
        if main:
            sent = self.client.update_weights(policy_weights_for_sync(model, self.accelerator),
                                              dtype=self.client.server_info.get("dtype"),
                                              chunk_bytes=self.chunk_bytes)
            logger.debug("Sent %d tensors to the vLLM server.", sent)
        elif is_zero3(self.accelerator):
            for _ in policy_weights_for_sync(model, self.accelerator):
                pass
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()
        self.needs_sync = False

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass  # the server outlives the run; stop it with VLLMServerClient(url).close_server()


def server_url(args) -> str:
    if args.vllm_server_base_url:
        return args.vllm_server_base_url.rstrip("/")
    host = "127.0.0.1" if args.vllm_server_host in ("0.0.0.0", "", None) else args.vllm_server_host
    return f"http://{host}:{args.vllm_server_port}"


def _port(base_url: str, args) -> int:
    return urlparse(base_url).port or args.vllm_server_port


def _timeout_message(method: str, url: str, timeout: float) -> str:
    return (f"{method} {url}: the vLLM server gave no answer within {timeout:g} s (vllm_server_request_timeout); "
            "it may be stuck or overloaded: check its log, or raise the timeout for very long generations.")


def _server_message(body: bytes) -> str:
    try:
        return json.loads(body).get("error") or body.decode(errors="replace")
    except Exception:
        return body.decode(errors="replace")


def _chunks(named_tensors, dtype: torch.dtype | None, chunk_bytes: int):
    """CPU copies of the tensors (floats cast to `dtype`), grouped into dicts of about `chunk_bytes`."""
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named_tensors:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        chunk[name] = tensor.detach().to(device="cpu", dtype=cast, copy=True).contiguous()
        size += chunk[name].numel() * chunk[name].element_size()
        if size >= chunk_bytes:
            yield chunk
            chunk, size = {}, 0
    if chunk:
        yield chunk


def _reason(error: Exception) -> str:
    reason = getattr(error, "reason", None)
    return str(reason if reason is not None else error)
