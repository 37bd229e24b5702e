"""PPO's value function (the critic), read from last hidden states, never from logits.

Two layouts, one interface (`ValueFunction.values`):

- shared body (no `value_model`): a `ValueHead` on the policy's own last hidden states, the ones its output head
  reads; with PEFT that is one frozen base, the policy's adapter and this head (no second network at all);
- a separate value model (TRL's `value_model`): its body runs on the same rows and its own scalar head (a
  sequence-classification model's `score`) or a new `ValueHead` reads its last hidden states.

The module is attached to the policy (`attach_value_function`), so the Trainer's optimizer, DDP/FSDP wrapping,
gradient synchronisation and checkpointing see its parameters with the policy's; `detached_value_function` takes it
off for saving the policy as it was given (the value function is written beside it, `VALUE_WEIGHTS_NAME`).
"""

from __future__ import annotations

import contextlib
import os

import torch
from safetensors.torch import load_file, save_file

from .output_head import ShardedOutputHead, text_config_of, unwrap_model

VALUE_ATTRIBUTE = "ppo_value_function"
VALUE_WEIGHTS_NAME = "value_function.safetensors"


class ValueHead(torch.nn.Module):
    """A scalar per position from its hidden state, computed in fp32; zero-initialised, so every value starts at 0
    (the critic learns the returns' scale instead of starting from a random one)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        torch.nn.init.zeros_(self.summary.weight)
        torch.nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.float()).squeeze(-1)


class ValueFunction(torch.nn.Module):
    """Values at the target positions: V(state before each completion token), [num_targets] fp32."""

    def __init__(self, hidden_size: int, value_model: torch.nn.Module | None = None):
        super().__init__()
        self.value_model = value_model
        score = _scalar_head(value_model) if value_model is not None else None
        self.head = None if score is not None else ValueHead(hidden_size if value_model is None
                                                             else text_config_of(value_model).hidden_size)

    @property
    def shares_policy_body(self) -> bool:
        return self.value_model is None

    def values(self, policy_hidden: torch.Tensor | None, inputs: dict, target_index: torch.Tensor) -> torch.Tensor:
        """From the policy's hidden states at the targets (shared body), or from the value model's own pass over
        `inputs`, its hidden states selected at the same flat target positions."""
        if self.value_model is None:
            return self.head(policy_hidden)
        hidden = _last_hidden_states(self.value_model, inputs)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_index)
        if self.head is not None:
            return self.head(rows)
        return _scalar_head(self.value_model)(rows).float()[..., 0]


def _scalar_head(model) -> torch.nn.Module | None:
    """A sequence-classification model's score layer (TRL's value models: AutoModelForSequenceClassification with
    num_labels=1), or None for a model without one (a causal LM or a bare body: a new ValueHead is added)."""
    head = getattr(unwrap_model(model), "score", None)
    return head if isinstance(head, torch.nn.Module) else None


def _last_hidden_states(model, inputs: dict) -> torch.Tensor:
    base = unwrap_model(model)
    if hasattr(base, "get_output_embeddings") and base.get_output_embeddings() is not None:
        head = ShardedOutputHead.of(model)  # a causal LM: its own forward, the head short-circuited (no logits), any engine
        with head.capture_hidden_states() as captured:
            model(**inputs, use_cache=False)
        return captured["hidden"]
    body = getattr(base, base.base_model_prefix, base)  # a sequence-classification model: its body, not its logits
    return body(**inputs, use_cache=False).last_hidden_state


def attach_value_function(policy: torch.nn.Module, value: ValueFunction) -> None:
    policy.add_module(VALUE_ATTRIBUTE, value)
    policy.register_load_state_dict_post_hook(value_weights_not_missing)


def value_weights_not_missing(policy: torch.nn.Module, incompatible_keys) -> None:
    """A checkpoint of the policy holds the policy as given; its value function's weights are in their own file
    (`load_value_function`), so a load of the policy (Trainer's resume) does not report them missing."""
    missing = incompatible_keys.missing_keys
    missing[:] = [key for key in missing if f"{VALUE_ATTRIBUTE}." not in key]


@contextlib.contextmanager
def detached_value_function(policy: torch.nn.Module):
    """The policy without its value function for the block (its save is then the model as given)."""
    value = policy._modules.pop(VALUE_ATTRIBUTE, None)
    try:
        yield value
    finally:
        if value is not None:
            policy._modules[VALUE_ATTRIBUTE] = value


def save_value_function(value: ValueFunction, output_dir: str, state_dict: dict | None = None) -> str:
    """`state_dict`: the value function's full weights where a sharding engine gathered them (its own
    parameters are then this process's shards)."""
    path = os.path.join(output_dir, VALUE_WEIGHTS_NAME)
    state = value.state_dict() if state_dict is None else state_dict
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in state.items()}, path)
    return path


def load_value_function(value: ValueFunction, folder: str) -> bool:
    """The weights `save_value_function` wrote in `folder`, if it holds them (a checkpoint of a PPO run)."""
    path = os.path.join(folder, VALUE_WEIGHTS_NAME)
    if not os.path.exists(path):
        return False

    value.load_state_dict(load_file(path, device=str(next(value.parameters()).device)))
    return True
