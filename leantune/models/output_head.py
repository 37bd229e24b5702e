"""The model's output projection, taken apart from the model so losses can apply it chunk by chunk.

A causal LM's forward ends in `lm_head(hidden)` followed, for some architectures, by a fixed transform of the
logits (Gemma's soft-capping, Cohere's `logit_scale`, Granite's `logits_scaling`). `OutputHead` reproduces that
last step for any slice of hidden states, in fp32, so the full [tokens, vocabulary] logits never need to exist.

`OutputHead.capture_hidden_states()` runs the model's own forward (through DDP/FSDP/PEFT wrappers and every
hook) with the head short-circuited: the head receives the final hidden states, keeps them, and returns an empty
slice, so no logits are computed and the model's post-processing costs nothing.

How the head is reached depends on the engine, chosen once when the trainer is built (`head_kind`): one process
uses the head as it is (`OutputHead`), DDP also keeps it in the forward's graph (`DDPOutputHead`), and ZeRO-3 / FSDP
run the chunks through the head module's hooks where its weights are sharded (`ShardedOutputHead`).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed support: no FSDP2 shards
    DTensor = None


def unwrap_model(model):
    """The transformers model under accelerate/DDP and PEFT wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def text_config_of(model):
    """The language model's config (a multimodal model's text part), or None."""
    config = getattr(unwrap_model(model), "config", None)
    return getattr(config, "get_text_config", lambda: config)() if config is not None else None


@dataclass
class OutputHead:
    """A model's head module and its fixed logit transform; `vocab_size`: how many tokens it scores (its output
    width), known once when the head is taken."""

    module: torch.nn.Module
    softcap: float | None = None
    scale: float = 1.0
    temperature: float = 1.0
    vocab_size: int = field(init=False)

    def __post_init__(self):
        self.vocab_size = output_width(self.module)

    @classmethod
    def of(cls, model, temperature: float = 1.0) -> OutputHead:
        base = unwrap_model(model)
        module = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        if module is None:
            raise ValueError(f"{type(base).__name__} has no output embeddings (lm_head) to compute log-probs from.")
        config = text_config_of(base)
        scale = 1.0
        if getattr(config, "logit_scale", None) is not None:  # Cohere
            scale *= float(config.logit_scale)
        if getattr(config, "logits_scaling", None):  # Granite
            scale /= float(config.logits_scaling)
        return cls(module, getattr(config, "final_logit_softcapping", None), scale, float(temperature))

    @property
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's own forward (an instance-level forward set by accelerate hooks is honoured)."""
        own = self.module.__dict__.get("forward")
        if own is not None:
            return own(hidden)
        return type(self.module).forward(self.module, hidden)

    def weights_sharded(self) -> bool:
        """Whether the head's weights are not all materialised here now: never for this class (one process and DDP
        hold the whole head in every process; `ShardedOutputHead` is the engines' that shard it)."""
        return False

    def call_as_head(self, function, *inputs):
        """`function(*inputs)`, a computation that reads the head's weight outside the model's forward (the chunked
        loss, and its recomputation in backward): the weights are whole here, used as they are."""
        return function(*inputs)

    def transform(self, raw: torch.Tensor) -> torch.Tensor:
        """fp32 logits from the projection's output: the model's fixed transform, then the temperature.

        Aliases `raw` when it is already fp32 and nothing is applied (callers may then overwrite it).
        """
        logits = raw.float()
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of `hidden` exactly as the model (and the sampling temperature) would produce them."""
        return self.transform(self.project(hidden))

    @contextlib.contextmanager
    def capture_hidden_states(self, head_follows: bool = False):
        """Within the block, calling the model stores the head's input in `captured["hidden"]` and computes no
        logits: the head returns an empty slice. `head_follows`: the caller projects the captured states through
        this head afterwards (the chunked loss), which DDP and the sharding engines need to know (their classes)."""
        captured, tied = {}, self.tied_parameters(head_follows)

        def keep_hidden(hidden, *args, **kwargs):
            captured.setdefault("hidden", hidden)
            empty = hidden[..., :0]
            for parameter in tied:  # in the forward's graph (DDPOutputHead); zero elements, no cost
                empty = empty + parameter.view(-1)[:0].sum().to(empty.dtype)
            return empty

        with _forward_replaced(self.module, keep_hidden):
            yield captured

    def tied_parameters(self, head_follows: bool) -> list[torch.nn.Parameter]:
        """The parameters the empty logits depend on: none (one process: nothing waits for the head's gradient)."""
        return []


class DDPOutputHead(OutputHead):
    """The head where every process holds it whole and an engine reduces its gradient (DDP, ZeRO-1/2).

    DDP with `find_unused_parameters=True` (transformers' choice without gradient checkpointing) marks every
    parameter its forward's outputs do not reach as unused, reduces it at once, and then fails when the chunked
    loss's gradient arrives ("Expected to mark a variable ready only once"). The empty logits of
    `capture_hidden_states(head_follows=True)` therefore depend on the head's trainable parameters through a
    zero-element sum: DDP sees them used and waits for their one gradient (exact: nothing flows back through an empty
    tensor). Callers that never project (a value model's body) leave it off, so DDP keeps treating their head as
    unused."""

    def tied_parameters(self, head_follows: bool) -> list[torch.nn.Parameter]:
        return self.trainable_parameters if head_follows else []


class ShardedOutputHead(DDPOutputHead):
    """The head under an engine that may keep its weights sharded (ZeRO-3, FSDP): their state is read at each call,
    since an FSDP2 head wrapped with its root module is whole during the model's forward and backward. Correct under
    every engine, it is also the head of callers that are not told theirs (a value model's body, a teacher)."""

    def weights_sharded(self) -> bool:
        """Whether the head's weights are not all materialised here now (a ZeRO-3 partition, an FSDP2 shard)."""
        for parameter in self.module.parameters():
            if getattr(parameter, "ds_status", None) is not None and parameter.ds_status.name != "AVAILABLE":
                return True
            if _is_dtensor(parameter):
                return True
        return False

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """`OutputHead.project`, also inside `call_as_head`, where the module's forward is the chunk's computation:
        the forward it replaced is the head's own."""
        own = self.module.__dict__.get("forward")
        if own is not None and hasattr(own, "_leantune_previous"):
            own = own._leantune_previous
        if own is not None:
            return own(hidden)
        return type(self.module).forward(self.module, hidden)

    def call_as_head(self, function, *inputs):
        """`function(*inputs)` run as the head module's forward, through the module's call and hooks.

        Engines that keep parameters sharded hook each module: ZeRO-3 gathers a module's parameters before its
        forward and again before its backward, FSDP2 (a head wrapped on its own) unshards it. Run this way, a
        computation that reads the head's weight outside the model's forward (the chunked loss, and its recomputation
        in backward) sees the full weight and gives the engine the weight's gradient as from the head itself.
        Weights that are already whole (an FSDP2 head unsharded with its root module for the model's forward and
        backward) are used as they are, without a second pass through the hooks."""
        if not self.weights_sharded():
            return function(*inputs)

        def as_forward(*args, **kwargs):
            return function(*args, **kwargs)

        with _forward_replaced(self.module, as_forward):
            return self.module(*inputs)

    def tied_parameters(self, head_follows: bool) -> list[torch.nn.Parameter]:
        """As DDP's, for weights that are whole as the capture starts and not hooked by ZeRO-3."""
        whole = not (self.weights_sharded() or _is_zero3_partitioned(self.module))
        return super().tied_parameters(head_follows and whole)

    @contextlib.contextmanager
    def capture_hidden_states(self, head_follows: bool = False):
        """`OutputHead.capture_hidden_states`; under ZeRO-3 the head's input is taken before the engine's hooks.

        ZeRO-3 wraps the head's input in a hook that releases the head's weight after its backward. The captured
        states are taken before that hook (a hook put first), so the loss's backward runs only the hooks of the head
        call the loss makes itself (`call_as_head`): one gather and one release per step, in the same order every
        step. Through the hooked input, the model's own head call released the weight a second time with nothing
        gathered for it, which DeepSpeed's prefetcher, replaying step 1's order from step 2, stops on
        ("active_backward_submodules is empty during backward pass")."""
        engine_hooked = _is_zero3_partitioned(self.module)
        with super().capture_hidden_states(head_follows) as captured:

            def before_engine_hooks(_module, args):
                if args:
                    captured["hidden"] = args[0]

            first = self.module.register_forward_pre_hook(before_engine_hooks, prepend=True) if engine_hooked else None
            try:
                yield captured
            finally:
                if first is not None:
                    first.remove()


def head_kind(sharded: bool, processes: int) -> type[OutputHead]:
    """The head an engine needs, chosen once when the trainer is built from the configured engine (not from the
    weights' state then: FSDP2 and ZeRO-3 wrap the model later, in `train()`): `sharded` (ZeRO-3, FSDP) ->
    `ShardedOutputHead`, else several processes -> `DDPOutputHead`, else `OutputHead`."""
    if sharded:
        return ShardedOutputHead
    return DDPOutputHead if processes > 1 else OutputHead


@contextlib.contextmanager
def _forward_replaced(module: torch.nn.Module, forward):
    """Within the block the module's forward is `forward`, which keeps the forward it replaced (an instance-level one,
    as accelerate hooks or `compute_head_in_fp32` set; None: the class's) for `ShardedOutputHead.project`."""
    previous = module.__dict__.get("forward")
    forward._leantune_previous = previous
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous

def output_width(module: torch.nn.Module) -> int:
    """How many tokens a head module scores."""
    for name in ("out_features", "num_embeddings"):
        if hasattr(module, name):
            return int(getattr(module, name))
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if weight is not None else 32768


def compute_head_in_fp32(model) -> None:
    """`cast_lm_head_to_fp32`: the output head projects float32 hidden states with a float32 copy of its weight (and
    bias), autocast off, wherever it runs (full logits, the chunked path's forward and backward, generate). The
    stored weight keeps its dtype, so a head tied to the input embeddings stays tied and the embeddings' outputs
    keep theirs. Refused for a head wrapped by a PEFT adapter, whose forward is the adapter's."""
    module = OutputHead.of(model).module
    if getattr(module, "_leantune_fp32", False):
        return
    if not isinstance(module, torch.nn.Linear) or hasattr(module, "base_layer"):
        raise ValueError(f"`cast_lm_head_to_fp32=True` needs a plain linear output head, got {type(module).__name__} "
                         "(a PEFT adapter on lm_head?); remove lm_head from the adapter's target modules or set "
                         "`cast_lm_head_to_fp32=False`.")
    if "forward" in module.__dict__:
        raise ValueError("`cast_lm_head_to_fp32=True`: the output head's forward is already replaced (an accelerate "
                         "device-map hook?); load the model on one device or set `cast_lm_head_to_fp32=False`.")
    module.forward = types.MethodType(_fp32_linear_forward, module)  # a bound method: deep copies follow the copy
    module._leantune_fp32 = True


def _fp32_linear_forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def _is_zero3_partitioned(module: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 manages the module's parameters (gathered and released by its hooks)."""
    return any(hasattr(parameter, "ds_id") for parameter in module.parameters())


def _is_dtensor(tensor) -> bool:
    """An FSDP2 shard (torch.distributed's DTensor; absent from builds without distributed support)."""
    return DTensor is not None and isinstance(tensor, DTensor)
