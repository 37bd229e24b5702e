"""leantune's version, in the lowest floor: the model card and the command line name it, and `leantune.__version__`
exports it."""

__version__ = "0.1.0"
