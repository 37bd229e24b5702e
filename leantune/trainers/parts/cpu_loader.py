"""No pinned host memory for the data loader on a machine without an accelerator.

Pinning only speeds copies to an accelerator; without one, torch's DataLoader warns on every loader it builds (twice
a CPU run: once per epoch iterator) and pins nothing. TrainingArguments pins by default.
"""

from __future__ import annotations

import torch


def accelerator_present() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def no_pinning_without_accelerator(config) -> None:
    """dataloader_pin_memory=False when the run is on CPU (use_cpu, or no accelerator): it could not pin anyway."""
    if getattr(config, "dataloader_pin_memory", False) and (getattr(config, "use_cpu", False)
                                                            or not accelerator_present()):
        config.dataloader_pin_memory = False
