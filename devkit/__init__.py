"""Development helpers that both tests/ and bench/ use, so that neither imports the other: liger-kernel on CPU under
Triton's interpreter, accelerate's FSDP and context parallelism on CPU processes (cpu_engines/, a folder put on a
launch's PYTHONPATH), bench/real_shapes.py's model shape, FLOPs count and longest-length search, and the comparison of
TRL's config fields with leantune's. Not part of the installed package."""
