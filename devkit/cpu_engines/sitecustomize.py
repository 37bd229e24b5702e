"""Development only (the tests' and bench's CPU launches): let accelerate's FSDP run on CPU processes over gloo (put
this folder on PYTHONPATH of a launched run).

accelerate turns FSDP on only for accelerator device kinds: with `use_cpu` (a machine without a GPU) an FSDP config
silently trains as plain data parallel (`DistributedType.MULTI_CPU`). torch's `fully_shard` itself works on a CPU
mesh over gloo, so after accelerate has built its state this switches a MULTI_CPU state that was asked for FSDP
(ACCELERATE_USE_FSDP, or an FSDP plugin) to FSDP, exactly as accelerate does for a GPU: the rule of leantune's
planner (planning/sharded.py), which traces GPU launches on CPU. A GPU user's run never sees this patch."""

import functools
import os


def _patch_accelerate_state():
    from accelerate import state as accelerate_state

    original_init = accelerate_state.AcceleratorState.__init__
    if getattr(original_init, "_leantune_cpu_fsdp", False):
        return

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        # the planner's own rule (it traces GPU launches on CPU the same way); imported at the first state, not at
        # startup: importing leantune imports triton, and every process of the launch starts with this file
        from leantune.planning.sharded import switch_cpu_state_to_fsdp

        original_init(self, *args, **kwargs)
        switch_cpu_state_to_fsdp(self, kwargs.get("fsdp_plugin"))

    init._leantune_cpu_fsdp = True
    accelerate_state.AcceleratorState.__init__ = init


if os.environ.get("LEANTUNE_TEST_CPU_FSDP") == "1":
    _patch_accelerate_state()
if os.environ.get("LEANTUNE_TEST_CPU_CP") == "1":  # context parallelism: ring attention for the CPU SDPA kernel
    import cpu_context_parallel

    cpu_context_parallel.install()
