"""Development helpers that both tests/ and bench/ use, so that neither imports the other: liger-kernel on CPU under
Triton's interpreter, and the comparison of TRL's config fields with leantune's. Not part of the installed package."""
