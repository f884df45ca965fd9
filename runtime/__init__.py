"""Everything that touches real PyTorch execution: capture, policies, application, measurement, hardware."""

from runtime.errors import AutotuneError

__all__ = ["AutotuneError"]
