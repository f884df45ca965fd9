"""Simulator and gymnasium environments (see ARCHITECTURE in the README)."""

#: The keep / swap / recompute / compress environment (envs/memory_env.py), for ``gymnasium.make``.
MEMORY_POLICY_ENV_ID = "autotune/MemoryPolicy-v1"

try:
    import gymnasium
except ImportError:  # the simulator and the runtime do not need it (a GPU box may run only `autotune train`)
    gymnasium = None  # type: ignore[assignment]

# Registered by name, so importing envs does not import the environment (nor agents, which it uses); a
# second import (importlib.reload, a test that re-imports) finds it registered and leaves it alone.
if gymnasium is not None and MEMORY_POLICY_ENV_ID not in gymnasium.registry:
    gymnasium.register(id=MEMORY_POLICY_ENV_ID, entry_point="envs.memory_env:MemoryPolicyEnv")
