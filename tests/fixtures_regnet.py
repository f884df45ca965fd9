"""A factory that builds a torchvision RegNet, importing torchvision's models where it is defined (as a user's
project does): referenced as ``tests.fixtures_regnet:make``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torchvision.models as tvm
from torch import nn


def make(batch_size: int = 2) -> tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]:
    batch = (torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,)))
    return tvm.regnet_y_400mf(num_classes=10), batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
