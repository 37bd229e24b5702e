"""Checkpoint offload's premise, on whichever transformers runs the suite: a decoder layer's module hooks run outside
its checkpoint (once per forward, not again in the backward's recompute), where the offload's hooks see the
checkpoint save the layer's input. A transformers that checkpoints the layer's whole call (5.17, the lower bound)
runs them inside, so there the offload is refused in one line, at config time and at install."""

from __future__ import annotations

import pytest
import torch

from leantune import SFTConfig
from leantune.memory.checkpoint_offload import install_checkpoint_offload, unsupported_by_transformers
from leantune.models.checkpointing import enable_model_checkpointing

from ..fixtures.models import tiny_model

pytestmark = pytest.mark.quick


def test_layer_hooks_run_outside_the_checkpoint_or_the_offload_is_refused(tmp_path):
    problem = unsupported_by_transformers()
    model = tiny_model()
    model.train()
    enable_model_checkpointing(model, {"use_reentrant": False})
    layer = model.model.layers[0]
    calls = []
    layer.register_forward_pre_hook(lambda module, args: calls.append(1))
    model(input_ids=torch.tensor([[1, 5, 9, 3]]), labels=torch.tensor([[1, 5, 9, 3]])).loss.backward()
    if problem is None:
        assert calls == [1]  # outside the checkpoint: the recompute did not run the layer's hooks again
        return
    assert len(calls) == 2  # inside: the hook ran again in the recompute, where the offload cannot work
    assert len(problem.splitlines()) == 1 and "checkpoint_offload_layers" in problem
    with pytest.raises(ValueError, match="checkpoint_offload_layers"):
        SFTConfig(output_dir=str(tmp_path), checkpoint_offload_layers=1)
    with pytest.raises(ValueError, match="checkpoint_offload_layers"):
        install_checkpoint_offload(model, 1)
