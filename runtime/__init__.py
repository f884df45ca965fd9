"""Everything that touches real PyTorch execution: capture, policies, application, measurement, hardware."""

from runtime.errors import AutotuneError
from runtime.policy import Action, Policy, PolicyOptions, load_policy

__all__ = ["Action", "AutotuneError", "Policy", "PolicyOptions", "load_policy"]
