"""What the budget search (recommend.py) knows of a run beyond its fields, and the techniques that depend on it:
whether the model's MLPs can be tiled (`tiled_mlp`), whether the optimizer step may run inside the backward
(`optimizer_in_backward`).

The step inside the backward is offered only where the run's config accepts it: the config class's own validation
(trainers/memory_options.py) refuses clipping (`max_grad_norm` > 0: TRL's default is 1.0, so a run must have turned
clipping off itself; the search never turns it off, which would change what is learned), fp16, DeepSpeed, FSDP, the
'skip' non-finite policy and the optimizers that step their own groups; the search also leaves it off for more than
one process, and for adapters (a LoRA run's gradients are its adapters', a few MiB: the step saves nothing worth a
candidate).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .planned_run import method_classes
from .tile_size import tiles_model


@dataclass(frozen=True)
class RunFacts:
    """The run the search sizes: its method's trainer class, the model's config, its explicit fields, its processes
    and engine, and whether it trains adapters."""

    trainer_class: object
    model_config: object
    fields: dict
    num_processes: int = 1
    engine: str = "ddp"
    adapters: bool = False


def tiling_supported(facts: RunFacts) -> bool:
    """`tiled_mlp` for a model whose decoder MLPs are all per-token ones the tiled MLP tiles."""
    return tiles_model(facts.model_config, facts.trainer_class)


def in_backward_supported(facts: RunFacts) -> bool:
    """`optimizer_in_backward` for a one-process full fine-tune whose config accepts it."""
    if facts.adapters or facts.num_processes > 1 or facts.engine != "ddp":
        return False
    _, config_class = method_classes(facts.trainer_class)
    names = {f.name for f in dataclasses.fields(config_class) if f.init}
    given = {k: v for k, v in facts.fields.items() if k in names and k not in ("output_dir", "use_cpu")}
    try:
        config_class(**{"output_dir": "/tmp/leantune-plan", "use_cpu": True, "report_to": [], **given,
                        "optimizer_in_backward": True})
    except (ValueError, TypeError):
        return False
    return True
