"""Frozen models the plan builds fake: a GKD teacher and reward models given by id, path or config.

A real run holds their weights through every step (the memory breakdown's "frozen_models" part), so the plan must
hold them too, without reading a weight: each is built from its `config.json` with fake parameters, in the dtype the
real run would load it in, and handed to the trainer as a model object. A reference copy needs nothing here: the
trainer deep-copies the fake policy itself. What the trainer does with the models afterwards (placement, freezing,
scoring) is its own code.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PretrainedConfig

from ..methods import REWARD_MODELS, TEACHER, of
from .fake_step import WeightlessMode, fake_model_from_config
from .planned_run import dtype_of, model_config_of


def fake_frozen_sources(trainer_class, fields: dict, trainer_kwargs: dict, mode: WeightlessMode,
                        tokenizer) -> tuple[dict, dict]:
    """(config fields, trainer keyword arguments) with every frozen model given by name or config replaced by a fake
    model object; the fields that named them are consumed (the trainer gets the object instead). Which frozen models
    a method takes is its entry's `frozen_models` (leantune/methods.py)."""
    takes = of(trainer_class).frozen_models
    fields, kwargs = dict(fields), dict(trainer_kwargs)
    teacher = None
    if TEACHER in takes:
        teacher = kwargs.pop("teacher_model", None) or fields.pop("teacher_model", None) or fields.pop(
            "teacher_model_name_or_path", None)
    if teacher is not None:
        init_kwargs = fields.pop("teacher_model_init_kwargs", None)  # applied here: the trainer gets an object
        kwargs["teacher_model"] = _fake(teacher, mode, None, _teacher_dtype(teacher, init_kwargs))
    funcs = kwargs.get("reward_funcs") if REWARD_MODELS in takes else None
    if isinstance(funcs, (list, tuple)) or _is_model_source(funcs):
        funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
        if any(_is_model_source(func) for func in funcs):
            kwargs["reward_funcs"] = [_fake_reward(func, mode) if _is_model_source(func) else func for func in funcs]
            kwargs["reward_processing_classes"] = [_reward_tokenizer(func, tokenizer) if _is_model_source(func)
                                                   else None for func in funcs]
    return fields, kwargs


def _is_model_source(value) -> bool:
    return isinstance(value, (str, PretrainedConfig)) or (isinstance(value, torch.nn.Module) and
                                                          hasattr(value, "config"))


def _fake(source, mode, model_class, dtype):
    return fake_model_from_config(model_config_of(source), mode, model_class, dtype)


def _fake_reward(source, mode):
    """A reward model as RewardFunctions loads one (a one-label sequence classifier, in its checkpoint's dtype: the
    trainers pass no dtype for it, and transformers loads "auto")."""
    config = copy.deepcopy(model_config_of(source))
    config.num_labels = 1
    dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with mode.building():
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    if isinstance(source, str):
        model.config._name_or_path = source
    return model


def _reward_tokenizer(source, tokenizer):
    """The reward model's own tokenizer when it names a checkpoint (no weights read), else the policy's."""
    if isinstance(source, str):
        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):
            pass
    if tokenizer is None:
        raise ValueError("`processing_class`: a reward model given by config needs a tokenizer; pass the policy's.")
    return tokenizer


def _teacher_dtype(teacher, init_kwargs):
    """As the planner's policy (planned_run.dtype_of): an object's own dtype; a name in float32 unless
    teacher_model_init_kwargs gives one ("auto": its checkpoint's)."""
    return dtype_of({"model_init_kwargs": init_kwargs if isinstance(init_kwargs, (dict, str)) else None}, teacher)
