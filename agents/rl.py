"""Reinforcement learning: MaskablePPO (sb3-contrib) trained on MemoryPolicyEnv for the problem at hand.

``--searcher ppo`` trains an agent on this problem's environment (one episode assigns an action to every
candidate; the reward is simulated samples/s relative to no policy when the policy fits, a penalty growing
with the excess when it does not). Its actor starts from the pretrained agent's weights
(agents/pretrained.py; a fresh actor if they cannot be read), its critic fresh. The answer is the best of:
the fitting policies its episodes produced (``env.best``), and the one pass (NOTE [ One pass ]: masked
rollout, then decoding with the simulator) of the actor before and after training. Small MLP (two layers
of 64), one torch thread (fastest for networks this small), episodic returns (gamma 1: the only reward is
at the end). When keep-all fits the budget, that is the answer at once.

``SearchContext.trials`` episodes at most: ``DEFAULT_EPISODES`` for None, and for 0 (the CLI without
``--trials``) until the time limit (it stopped at ``DEFAULT_EPISODES`` whatever the time limit, 6 s of a 10 s
search). Deterministic for a seed when the episodes end before the time limit.

Where the problem has rivals (the same model traced with other partitions: NOTE [ Choosing a partition ] C5 in
autotune/partitions.py), the agent chooses the partition too: it learns on
:class:`envs.memory_env.PartitionChoiceEnv`, whose first action takes a partition (its mask: those whose floor
is within the budget) and the rest decide that partition's candidates; the one passes run on each partition.
"""

from __future__ import annotations

import time
from typing import Any

from agents.base import Problem, Proposal, SearchContext, Searcher, better, register

DEFAULT_EPISODES = 40


@register
class MaskablePPOSearcher(Searcher):
    name = "ppo"
    composite = True
    chooses_partition = True  # PartitionChoiceEnv's first action, where the problem has rivals
    summary = "MaskablePPO (sb3-contrib) trained on MemoryPolicyEnv for this problem; the best policy seen wins"

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        import torch
        from sb3_contrib import MaskablePPO
        from stable_baselines3.common.callbacks import BaseCallback
        from stable_baselines3.common.logger import Logger

        from agents.pretrained import from_sb3, one_pass
        from envs.memory_env import MemoryPolicyEnv, PartitionChoiceEnv

        members = problem.members
        env: MemoryPolicyEnv | PartitionChoiceEnv
        if len(members) > 1:
            env = family = PartitionChoiceEnv(list(members))
            fits = [i for i, e in enumerate(family.envs) if e.baseline.feasible]
            if fits:  # a partition whose model fits as it is: the fastest such keep-all (nothing is faster)
                i = max(fits, key=lambda j: family.envs[j].baseline.samples_per_s)
                return Proposal(members[i].keep_all(), note="keeping everything fits the budget", rival=i - 1)
        else:
            env = MemoryPolicyEnv(problem, allow_compress=problem.allow_compress)
            if env.baseline.feasible:  # no policy fits: nothing to learn (and nothing is faster)
                return Proposal(problem.keep_all(), note="keeping everything fits the budget")
        k = env.k
        deadline = None if ctx.time_limit_s is None else time.perf_counter() + ctx.time_limit_s
        # SearchContext.trials: None the default (reproducible), 0 no bound but the time limit (the CLI's default)
        episodes = ctx.trials or (10**9 if ctx.trials == 0 and deadline is not None else DEFAULT_EPISODES)
        n_steps = max(64, min(2048, 4 * k))

        class Stop(BaseCallback):  # type: ignore[misc]
            """Ends learning at the deadline or on Ctrl-C (the best policy so far stands)."""

            def _on_step(self) -> bool:
                if env.best is not None and self.n_calls % k == 0:
                    ctx.report("ppo", env.best.result)
                return deadline is None or time.perf_counter() < deadline

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            model = MaskablePPO(
                "MlpPolicy",
                env,
                n_steps=n_steps,
                batch_size=64,
                gamma=1.0,
                learning_rate=3e-4,
                ent_coef=0.01,
                policy_kwargs={"net_arch": [64, 64]},
                seed=ctx.seed,
                device="cpu",
                verbose=0,
            )
            model.set_logger(Logger(None, []))  # SB3's default makes an empty folder in /tmp per learn()
            warm = WARM_START and _warm_start(model)

            def passes() -> tuple[Any, int]:
                """The actor's one pass on each partition (agents/pretrained.py: its rollout, decoded with
                the simulator), the best with its member (-1: the problem itself)."""
                done = [(one_pass(from_sb3(model.policy), m), i - 1) for i, m in enumerate(members)]
                top = done[0]
                for d in done[1:]:
                    top = d if better(d[0].result, top[0].result) else top
                return top

            # The pretrained actor's one pass is the first policy seen (PPO's first updates can undo it).
            first = passes() if warm else None
            try:
                model.learn(total_timesteps=episodes * k, callback=Stop())
            except KeyboardInterrupt:
                ctx.interrupt()
            start = "pretrained actor" if warm else "fresh actor"
            decoded, rival = passes()
            how = f"the trained actor's one pass, after {env.episodes} episodes ({start})"
            if first is not None and better(first[0].result, decoded.result):
                decoded, rival = first
                how = f"the pretrained actor's one pass, before {env.episodes} episodes of training"
            best_rival = env.best_rival if isinstance(env, PartitionChoiceEnv) else -1
            if env.best is not None and not better(decoded.result, env.best.result):
                note = f"best of {env.episodes} episodes ({start})"
                return Proposal(env.best.actions.copy(), note=note, rival=best_rival)
            return Proposal(decoded.actions, options=decoded.options, note=how, rival=rival)
        finally:
            torch.set_num_threads(threads)


WARM_START = True


def _warm_start(model: Any) -> bool:
    """Start the actor from the pretrained agent's weights (agents/pretrained.py) when their shapes agree;
    the critic starts fresh. False (a fresh actor) when they do not or the file cannot be read."""
    from agents.pretrained import into_sb3, load_agent
    from runtime.errors import AutotuneError

    try:
        into_sb3(load_agent(), model.policy)
    except (AutotuneError, ValueError, RuntimeError):
        return False
    return True
