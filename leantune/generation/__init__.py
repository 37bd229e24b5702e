"""Generating completions for the online trainers: one interface, three backends (transformers generate, vLLM in
the training process, a vLLM server), and the weight movement each needs (sync, sleep, ZeRO-3 gathering)."""

from .backend import GenerationBackend, make_backend
from .sampling import Completions, GenerationSession, SamplingSettings

__all__ = ["Completions", "GenerationBackend", "GenerationSession", "SamplingSettings", "make_backend"]
