"""Tests that need a CUDA GPU: each module is marked `cuda` and skips where torch sees none.

Run them on a GPU machine with `python -m pytest tests/gpu -m cuda`."""

from __future__ import annotations

import pytest
import torch

cuda = [pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(),
                           reason="needs a CUDA GPU: torch.cuda.is_available() is False here")]
