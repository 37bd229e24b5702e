"""Arguments the command line adds to a trainer config: where the data and the model come from."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from peft import LoraConfig

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
