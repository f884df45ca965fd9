"""The MaskablePPO searcher on MemoryPolicyEnv: masks honoured, deterministic under a seed, warm-started from
the pretrained agent, and the best policy it saw is its answer."""

from __future__ import annotations

import numpy as np

from agents.base import Problem, SearchContext, get_searcher
from agents.pretrained import from_sb3, one_pass
from envs.memory_env import MemoryPolicyEnv
from runtime.hardware import get_profile
from runtime.trace import capture
from runtime.vocab import COMPRESS
from runtime.workload import peak_report
from tests.test_trace import tiny_cnn_build

_W = capture(tiny_cnn_build(batch=4), name="cnn", batch_size=4)
_HW = get_profile("v100-16gb")
_PEAK = peak_report(_W, _HW.alloc_granularity_bytes).peak_bytes


def problem() -> Problem:
    return Problem(_W, _HW, budget_bytes=int(_PEAK * 0.9))


def context(seed: int = 0) -> SearchContext:
    return SearchContext(time_limit_s=60, trials=40, seed=seed)


def test_ppo_answers_with_its_best_policy_never_below_the_pretrained_one_pass() -> None:
    p = problem()
    r = get_searcher("ppo").search(p, context())
    assert r.feasible and "episodes" in r.note and "pretrained actor" in r.note
    assert p.evaluate(r.policy.to_vector(_W), r.policy.options) == r.result
    first = get_searcher("ppo-onepass").search(problem())  # the warm-started actor's one pass before training
    assert r.result.samples_per_s >= first.result.samples_per_s


def test_ppo_without_the_pretrained_actor_starts_fresh(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from agents import rl

    monkeypatch.setattr(rl, "WARM_START", False)
    r = get_searcher("ppo").search(problem(), context())
    assert r.feasible and "fresh actor" in r.note


def test_ppo_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """SB3 makes an empty folder (``SB3-<time>``) in the temporary folder at every ``learn()`` that has no logger
    of its caller's: one per search, 190 in one day of this suite's runs."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert get_searcher("ppo").search(problem(), context()).feasible
    assert list(tmp_path.iterdir()) == []


def test_ppo_is_deterministic_under_a_seed() -> None:
    a = get_searcher("ppo").search(problem(), context(seed=7)).policy.to_vector(_W)
    b = get_searcher("ppo").search(problem(), context(seed=7)).policy.to_vector(_W)
    assert np.array_equal(a, b)


def test_greedy_rollout_honours_the_masks() -> None:
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.logger import Logger

    env = MemoryPolicyEnv(problem(), allow_compress=False)
    model = MaskablePPO("MlpPolicy", env, n_steps=64, batch_size=32, seed=0, device="cpu")
    model.set_logger(Logger(None, []))  # SB3's default leaves an empty folder in /tmp
    model.learn(total_timesteps=64)
    obs, _ = env.reset()
    done = False
    while not done:
        mask = env.action_masks()
        action, _ = model.predict(obs, deterministic=True, action_masks=mask)
        assert mask[int(action)]
        obs, _, done, _, _ = env.step(action)
    vec = one_pass(from_sb3(model.policy), problem(), stages=()).actions  # the same rollout, as the searcher runs it
    assert not np.any(vec == COMPRESS) and len(vec) == len(_W.candidates)


def test_without_trials_it_trains_until_the_time_limit() -> None:
    """`--searcher ppo` without --trials stopped after 40 episodes whatever --timeout said (6.1 s of a 10 s search,
    a QA run); --trials [default: until --timeout] (trials 0). With trials, that many episodes; None, 40."""
    import re

    bounded = get_searcher("ppo").search(problem(), SearchContext(time_limit_s=60, trials=5, seed=0))
    assert re.search(r"\b5 episodes", bounded.note), bounded.note
    r = get_searcher("ppo").search(problem(), SearchContext(time_limit_s=3, seed=0, trials=0))  # the CLI's default
    episodes = int(re.search(r"(\d+) episodes", r.note).group(1))  # type: ignore[union-attr]
    assert r.wall_s >= 2.5 and episodes > 40, (r.wall_s, r.note)
