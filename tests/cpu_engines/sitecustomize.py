"""Test-only: let accelerate's FSDP run on CPU processes over gloo (put this folder on PYTHONPATH of a launched run).

accelerate turns FSDP on only for accelerator device kinds: with `use_cpu` (a machine without a GPU) an FSDP config
silently trains as plain data parallel (`DistributedType.MULTI_CPU`). torch's `fully_shard` itself works on a CPU
mesh over gloo, so after accelerate has built its state this switches a MULTI_CPU state that was asked for FSDP
(ACCELERATE_USE_FSDP, or an FSDP plugin) to FSDP, exactly as accelerate does for a GPU. Nothing of this is in
leantune: a GPU user's run never sees it."""

import functools
import os


def _patch_accelerate_state():
    from accelerate import state as accelerate_state
    from accelerate.utils import DistributedType

    original_init = accelerate_state.AcceleratorState.__init__
    if getattr(original_init, "_leantune_cpu_fsdp", False):
        return

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        fsdp_plugin = kwargs.get("fsdp_plugin")
        asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or fsdp_plugin is not None
        if asked and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if fsdp_plugin is not None:
                if self._mixed_precision != "no":
                    fsdp_plugin.set_mixed_precision(self._mixed_precision)
                self.fsdp_plugin = fsdp_plugin
            accelerate_state.PartialState._shared_state["distributed_type"] = self.distributed_type

    init._leantune_cpu_fsdp = True
    accelerate_state.AcceleratorState.__init__ = init


if os.environ.get("LEANTUNE_TEST_CPU_FSDP") == "1":
    _patch_accelerate_state()
if os.environ.get("LEANTUNE_TEST_CPU_CP") == "1":  # context parallelism: ring attention for the CPU SDPA kernel
    import cpu_context_parallel

    cpu_context_parallel.install()
