"""TEMP(online): the log-prob path's choice moved to trainers/parts/logprob_engine.py; this name stays until the online
trainers import it from there."""

from ..trainers.parts.logprob_engine import (  # noqa: F401
    LogProbPath,
    choose_logprob_path,
    liger_unavailable_reason,
    triton_interpreter_on,
)
