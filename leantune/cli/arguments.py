"""The command line's argument classes: what it adds to a trainer config (where the data and the model come from),
and the flags of `leantune plan`, `profile` and `vllm-serve`; `argument_types` and `plan_argument_types`: a command's
classes, as its parser and its `--help` (help_render.py, without the commands' own modules) take them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from peft import LoraConfig

from ..methods import BY_COMMAND, Method
from ..utils import imports


@dataclass
class ColumnArguments:
    """Other column names read as the standard ones: `--prompt_column question` reads 'question' as 'prompt'."""

    prompt_column: str | None = field(default=None, metadata={"help": "Column to read as 'prompt' (e.g. question)."})
    completion_column: str | None = field(
        default=None, metadata={"help": "Column to read as 'completion' (e.g. answer)."}
    )
    messages_column: str | None = field(default=None, metadata={"help": "Column to read as 'messages'."})
    chosen_column: str | None = field(default=None, metadata={"help": "Column to read as 'chosen'."})
    rejected_column: str | None = field(default=None, metadata={"help": "Column to read as 'rejected'."})

    def column_mapping(self) -> dict[str, str]:
        """{file's column: standard column}."""
        names = ("prompt", "completion", "messages", "chosen", "rejected")
        return {getattr(self, f"{name}_column"): name for name in names
                if getattr(self, f"{name}_column") not in (None, name)}


@dataclass
class ScriptArguments(ColumnArguments):
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub dataset name, local folder, or json/jsonl/parquet/csv file (comma-separate several)."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on, when eval is enabled."})
    dataset_streaming: bool = field(
        default=False,
        metadata={"help": "Read the data as a stream (datasets.IterableDataset): rows are prepared as they are read, "
                  "nothing is held whole. Needs --max_steps."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start over in an output_dir that holds an earlier run's checkpoints (they are deleted). "
                  "Without it such a run stops; --resume_from_checkpoint true continues the earlier run."},
    )


@dataclass
class ModelConfig:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Model id on the Hub or a local folder."})
    model_revision: str = field(default="main", metadata={"help": "Model revision (branch, tag or commit)."})
    dtype: str | None = field(default=None, metadata={"help": "auto, float32, bfloat16 or float16."})
    attn_implementation: str | None = field(default=None, metadata={"help": "eager, sdpa, flash_attention_2, ..."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "Modules to adapt (default: PEFT's)."})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={"help": "Modules trained in full."})
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "PEFT task type."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA scaling."})
    load_in_8bit: bool = field(default=False, metadata={"help": "8-bit weights (bitsandbytes; GPU or CPU)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "4-bit weights (bitsandbytes; GPU or CPU)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "fp4 or nf4."})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Quantise the quantisation constants too."})

    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("Choose one of `load_in_8bit` and `load_in_4bit`.")
        if (self.load_in_8bit or self.load_in_4bit) and not self.use_peft:
            raise ValueError("A 4/8-bit model can only be trained through an adapter: add `use_peft`.")
        if self.load_in_8bit or self.load_in_4bit:
            if not imports.is_available("bitsandbytes"):  # before any model or data is loaded
                flag = "load_in_4bit" if self.load_in_4bit else "load_in_8bit"
                raise ValueError(f"`{flag}` needs bitsandbytes, which is not installed: "
                                 "pip install 'leantune[bitsandbytes]'")
        if not self.use_peft:
            defaults = {f.name: f.default for f in fields(self)}
            unused = [name for name in defaults if name.startswith("lora_") or name == "use_rslora"]
            unused = [name for name in unused if getattr(self, name) != defaults[name]]
            if unused:
                raise ValueError(f"`{unused[0]}` has no effect without `use_peft`: add `use_peft` true to train a "
                                 "LoRA adapter, or drop it.")


def model_init_kwargs_from(model_args: ModelConfig) -> dict:
    kwargs = {"revision": model_args.model_revision}  # trust_remote_code: a field of every trainer config
    if model_args.dtype:
        kwargs["dtype"] = model_args.dtype
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    if model_args.load_in_4bit or model_args.load_in_8bit:
        kwargs["quantization_config"] = {
            "load_in_4bit": model_args.load_in_4bit,
            "load_in_8bit": model_args.load_in_8bit,
            "bnb_4bit_quant_type": model_args.bnb_4bit_quant_type,
            "bnb_4bit_use_double_quant": model_args.use_bnb_nested_quant,
        }
    return kwargs


def peft_config_from(model_args: ModelConfig):
    if not model_args.use_peft:
        return None

    return LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=_target_modules(model_args.lora_target_modules),
        modules_to_save=model_args.lora_modules_to_save,
        task_type=model_args.lora_task_type,
        use_rslora=model_args.use_rslora,
    )


def _target_modules(names):
    """PEFT reads its "all-linear" shortcut only as a string, and a flag of several values arrives as a list."""
    if names is not None and len(names) == 1 and names[0] == "all-linear":
        return "all-linear"
    return names


@dataclass
class RewardArguments:
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions: built-in names (correct_answer, characters_in_place), "
                  "package.module:function, or reward models (Hub id or folder). Needed with --dataset_name."},
    )


def argument_types(method: Method) -> tuple:
    if method.online:
        return (ScriptArguments, RewardArguments, ModelConfig, method.config_class)
    return (ScriptArguments, ModelConfig, method.config_class)


@dataclass
class PlanArguments:
    method: str = field(default="sft", metadata={"help": f"{', '.join(BY_COMMAND)} (any leantune trainer); --help "
                                                         "then lists its fields."})
    num_processes: int = field(default=1, metadata={"help": "Processes of the launch (per-process plan)."})
    engine: str = field(default="ddp", metadata={"help": "ddp, fsdp2, zero2, zero3 (with --deepspeed: the run's "
                                                          "DeepSpeed config file); cp: not planned yet."})
    rank: int = field(default=0, metadata={"help": "With --num_processes > 1: the process whose batches the "
                                           "measured step's plan uses."})
    device: str | None = field(
        default=None, metadata={"help": "A GPU name (h100, a100-40gb, l4, ...) to list its terms beyond the trace."})
    memory_budget: str | None = field(
        default=None, metadata={"help": "24GiB or a GPU name: also plan the candidates that learn the same thing and "
                                "name the fastest that fits."})
    host_memory: str | None = field(
        default=None, metadata={"help": "The run's host memory (e.g. 128GiB) that checkpoint_offload_layers and "
                                "ZeRO-Offload (offload_optimizer.device: cpu) are held to together, when planning "
                                "for another machine (default: this machine's available memory)."})
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer id or folder, when --model_name_or_path holds only config.json."})
    plan_json: str | None = field(default=None, metadata={"help": "Also write the plan as JSON to this file."})
    lengths: str | None = field(
        default=None, metadata={"help": "leantune profile's JSON: plan rows of its lengths instead of --dataset_name."})
    solve: str | None = field(
        default=None, metadata={"help": "With --memory_budget, the largest that fits: max_length (offline methods, "
                                "up to the data's longest row), or max_completion_length or "
                                "max_completions_per_generate (online methods: the prompt groups and global batch "
                                "kept)."})


def plan_argument_types(method: Method) -> tuple:
    """The flags of `leantune plan --method <method>`: the plan's own, then the method's command's (online methods'
    --reward_funcs too)."""
    return (PlanArguments, *argument_types(method))


FIGURE_NAME = "length_profile.png"
JSON_NAME = "length_profile.json"


@dataclass
class ProfileArguments(ColumnArguments):
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub dataset name, local folder, or json/jsonl/parquet/csv file (comma-separate several)."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to profile."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer id on the Hub or local folder."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Used as the tokenizer when --tokenizer is not given."}
    )
    chat_template_path: str | None = field(
        default=None, metadata={"help": "A Jinja chat-template file (or tokenizer dir) to use instead of the tokenizer's."}
    )
    dataset_text_field: str = field(default="text", metadata={"help": "Column holding text for language-modelling data."})
    eos_token: str | None = field(default=None, metadata={"help": "EOS token appended to each example (default: tokenizer's)."})
    max_lengths: list[int] | None = field(
        default=None, metadata={"help": "Candidate max_length values (default: powers of two around the data)."}
    )
    batch_size: int = field(default=8, metadata={"help": "Examples per batch (per_device_train_batch_size)."})
    keep_threshold: float = field(
        default=0.99,
        metadata={"help": "Recommend the smallest multiple of 64 keeping at least this share of tokens (0.99 = 99%%)."},
    )
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad each batch to a multiple of this."})
    num_proc: int | None = field(default=None, metadata={"help": "Tokenisation processes (default: all cores)."})
    seed: int = field(default=42, metadata={"help": "Seed of the random batches used for padding numbers."})
    max_examples: int | None = field(default=None, metadata={"help": "Profile only the first N examples."})
    output_dir: str = field(
        default="leantune-output/profile", metadata={"help": f"Where {FIGURE_NAME} and {JSON_NAME} are written."}
    )
    figure: bool = field(default=True, metadata={"help": f"Write {FIGURE_NAME} (false: only the JSON)."})


@dataclass
class VLLMServeArguments:
    model: str | None = field(default=None, metadata={"help": "Model id on the Hub or a local folder (the policy's "
                                                               "starting checkpoint; trainers sync their weights)."})
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on. Other than loopback, it needs a "
                                                             "token in $LEANTUNE_VLLM_SERVER_TOKEN."})
    allowed_hosts: str = field(default="", metadata={"help": "Other names clients reach it by, comma-separated (a "
                                                             "request's Host must name the server)."})
    port: int = field(default=8000, metadata={"help": "Port to listen on."})
    engine: str = field(default="vllm", metadata={"help": "vllm, or transformers (CPU; for tests and debugging)."})
    dtype: str = field(default="auto", metadata={"help": "auto, bfloat16, float16 or float32."})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "vLLM: share of GPU memory it may take."})
    max_model_len: int | None = field(default=None, metadata={"help": "vLLM: context length (default: model's)."})
    tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM: GPUs to shard the model over."})
    enforce_eager: bool = field(default=False, metadata={"help": "vLLM: no CUDA graphs (faster start, slower decode)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "vLLM: allow custom model code from the Hub."})
    seed: int = field(default=0, metadata={"help": "Seed of the engine's sampling."})
    max_request_mb: int = field(default=8192, metadata={"help": "Largest request body (a weight chunk) accepted, MiB "
                                                                "(at most the model's size plus 64 MiB)."})
    max_prompts: int = field(default=1024, metadata={"help": "Most prompts one /generate request may carry."})
    max_new_tokens: int | None = field(default=None, metadata={"help": "Most new tokens a request may ask per "
                                                                        "prompt (default: the context length)."})
    max_connections: int = field(default=32, metadata={"help": "Authenticated requests served at once; more get "
                                                               "HTTP 503."})
    max_open_connections: int = field(default=512, metadata={"help": "Connections open at once, idle ones included; "
                                                                     "more get HTTP 503."})
    socket_timeout: float = field(default=60.0, metadata={"help": "Seconds a request body may stall."})
    head_timeout: float = field(default=10.0, metadata={"help": "Seconds a connection has to send a whole request "
                                                                "head (also between requests)."})
    update_expiry: float = field(default=600.0, metadata={"help": "Seconds after its last chunk that an unfinished "
                                                                  "weight update is discarded."})
