"""A CUDA-only setting asked for on a machine without CUDA is one error naming the setting (utils/cuda.py)."""

from __future__ import annotations

import pytest
import torch

from leantune.utils.cuda import require_cuda
from leantune.utils.imports import NeedsGPUError

pytestmark = pytest.mark.quick


def test_a_cuda_only_setting_names_itself_where_there_is_no_cuda():
    if torch.cuda.is_available():
        assert require_cuda("vLLM's sleep mode") is None
        return
    with pytest.raises(NeedsGPUError, match=r"^vLLM's sleep mode needs a CUDA GPU, and none is visible"):
        require_cuda("vLLM's sleep mode")
