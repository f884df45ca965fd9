"""Simulator and gymnasium environments (see ARCHITECTURE in the README)."""

import gymnasium

#: The keep / swap / recompute / compress environment (envs/memory_env.py), for ``gymnasium.make``.
MEMORY_POLICY_ENV_ID = "autotune/MemoryPolicy-v0"

# Registered by name, so importing envs does not import the environment (nor agents, which it uses); a
# second import (importlib.reload, a test that re-imports) finds it registered and leaves it alone.
if MEMORY_POLICY_ENV_ID not in gymnasium.registry:
    gymnasium.register(id=MEMORY_POLICY_ENV_ID, entry_point="envs.memory_env:MemoryPolicyEnv")
