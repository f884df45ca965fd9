"""The gymnasium environment (envs/memory_env.py): API checkers, rewards computed by hand from the simulator,
action masks, observation bounds, determinism, the best policy across episodes, and the real backend."""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from agents.base import Problem
from autotune.real_backend import real_backend
from envs.features import compute_features
from envs.memory_env import OBS_FIELDS, OBS_SIZE, MemoryPolicyEnv
from envs.simulator import Simulator
from runtime.hardware import calibrate_cpu, get_profile
from runtime.synthetic import synthetic_workload
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP
from runtime.workload import peak_report
from tests.synthetic import chain_workload, fixed_profile

S = 1000  # bytes per tensor of the chain workload
TAU = 1e-3  # seconds per op
ENV_ID = "autotune/MemoryPolicy-v1"


@pytest.fixture
def no_warnings() -> Iterator[None]:
    """Any warning (gymnasium's checkers emit theirs as warnings) fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def chain_env(budget_bytes: int, n: int = 8, **kwargs: Any) -> MemoryPolicyEnv:
    """The 8-layer chain of tests/synthetic.py: keep-all peaks at 10 tensors (x, c_0..c_7, g_0)."""
    return MemoryPolicyEnv(workload=chain_workload(n, S, TAU), hardware=fixed_profile(), budget_bytes=budget_bytes,
                           **kwargs)  # fmt: skip


def run_episode(
    env: MemoryPolicyEnv, actions: Sequence[int] | np.ndarray, seed: int | None = None
) -> tuple[float, dict[str, Any]]:
    """Reset, play ``actions`` (one per candidate) and return the final reward and info."""
    env.reset(seed=seed)
    assert len(actions) == env.k
    for i, a in enumerate(actions):
        _, reward, terminated, truncated, info = env.step(a)
        assert terminated == (i == env.k - 1) and not truncated
        assert reward == 0.0 or terminated
    return reward, info


# -- the API checkers ------------------------------------------------------------------------------------------
def test_gymnasium_checker_on_the_registered_default(no_warnings: None) -> None:
    env = gymnasium.make(ENV_ID)
    check_env(env.unwrapped)  # with the render check: the spec makes an "ansi" copy and renders it
    env.close()


@pytest.mark.parametrize("allow_compress", [False, True])
def test_gymnasium_checker_on_a_problem(no_warnings: None, allow_compress: bool) -> None:
    w = synthetic_workload(blocks=2)
    env = gymnasium.make(ENV_ID, workload=w, budget_bytes=1, allow_compress=allow_compress, render_mode="ansi")
    check_env(env.unwrapped)  # made through the registry: the render check can make an "ansi" copy


def test_an_environment_made_on_a_problem_keeps_its_spec_and_pickles(no_warnings: None) -> None:
    """README's ``gymnasium.make(ENV_ID, problem=Problem(...))``: gymnasium deep-copies the keyword arguments into
    the spec, and a hardware profile's rates (a ``mappingproxy``) could not be copied: the environment had no
    spec (``gymnasium.make(env.spec)`` failed) and a warning printed the whole workload (a QA run). A problem
    and its environment pickle too (to a worker process)."""
    import pickle

    hw = get_profile("a100-40gb")
    problem = Problem(synthetic_workload(blocks=2), hw, budget_bytes=1 << 30)
    env = gymnasium.make(ENV_ID, problem=problem)
    assert env.spec is not None
    again = gymnasium.make(env.spec)
    assert again.unwrapped.k == env.unwrapped.k
    assert pickle.loads(pickle.dumps(hw)) == hw
    assert pickle.loads(pickle.dumps(problem)).hardware == hw
    pickle.loads(pickle.dumps(env.unwrapped))


def test_stable_baselines3_checker(no_warnings: None) -> None:
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    sb3_check_env(MemoryPolicyEnv())
    sb3_check_env(gymnasium.make(ENV_ID))


def test_registration_is_idempotent(no_warnings: None) -> None:
    importlib.reload(envs)
    importlib.reload(envs)
    assert gymnasium.spec(ENV_ID).entry_point == "envs.memory_env:MemoryPolicyEnv"


def test_default_problem_is_the_synthetic_cnn_at_60_percent() -> None:
    env = MemoryPolicyEnv()
    w = env.problem.workload
    assert w.model == "synthetic-cnn3" and env.k == len(w.candidates) == 9
    peak = Simulator(w, get_profile("a100-40gb")).run(np.zeros(env.k, dtype=np.int8)).peak_bytes
    assert env.budget_bytes == int(0.6 * peak)
    assert peak == peak_report(w, get_profile("a100-40gb").alloc_granularity_bytes).peak_bytes
    # Candidates in save order (the order runtime.trace records them).
    saves = [c.save_op for c in w.candidates]
    assert saves == sorted(saves)
    # The default budget can be met (recompute the first convolution and both later feature maps, swap
    # the rest that matters), but not by keeping everything.
    assert env.baseline.peak_bytes > env.budget_bytes
    fits = np.array([RECOMPUTE, SWAP, RECOMPUTE, KEEP, RECOMPUTE, KEEP, KEEP, KEEP, SWAP], dtype=np.int8)
    assert Simulator(w, get_profile("a100-40gb")).run(fits).peak_bytes <= env.budget_bytes


# -- rewards ----------------------------------------------------------------------------------------------------
def test_keep_all_that_fits_scores_exactly_one() -> None:
    env = chain_env(10 * S)
    reward, info = run_episode(env, [KEEP] * env.k)
    assert reward == 1.0
    assert info["feasible"] and info["peak_bytes"] == 10 * S
    assert np.array_equal(info["actions"], np.zeros(env.k, dtype=np.int8))
    assert info["samples_per_s"] == env.baseline.samples_per_s


def test_keep_all_over_budget_pays_the_relative_excess() -> None:
    w = synthetic_workload()
    hw = get_profile("a100-40gb")
    peak = Simulator(w, hw).run(np.zeros(len(w.candidates), dtype=np.int8)).peak_bytes
    budget = int(0.7 * peak)
    env = MemoryPolicyEnv(workload=w, hardware=hw, budget_bytes=budget)
    reward, info = run_episode(env, [KEEP] * env.k)
    assert reward == -1 - (peak - budget) / budget
    assert not info["feasible"] and info["peak_bytes"] == peak
    assert env.best is None  # nothing feasible yet


def test_a_feasible_policy_scores_its_throughput_ratio() -> None:
    """Recomputing c_0 of the chain re-runs one op (17 instead of 16) and takes one tensor off the peak."""
    env = chain_env(9 * S)
    actions = np.zeros(env.k, dtype=np.int8)
    actions[0] = RECOMPUTE
    reward, info = run_episode(env, actions)
    expected = Simulator(env.problem.workload, fixed_profile()).run(actions, budget_bytes=9 * S)
    assert expected.feasible and info["feasible"] and info["peak_bytes"] == expected.peak_bytes == 9 * S
    assert reward == expected.samples_per_s / env.baseline.samples_per_s == pytest.approx(16 / 17)


def test_every_simulation_is_counted_on_the_problem() -> None:
    """One run for the baseline, then one per non-keep step: keeps do not change the partial policy."""
    problem = Problem(chain_workload(8, S, TAU), fixed_profile(), budget_bytes=9 * S)
    env = MemoryPolicyEnv(problem)
    assert problem.evaluations == 1
    run_episode(env, [KEEP, SWAP, KEEP, RECOMPUTE, KEEP, KEEP, KEEP, KEEP])
    assert problem.evaluations == 3


# -- masks ------------------------------------------------------------------------------------------------------
def test_the_actions_reported_are_the_ones_scored() -> None:
    """A compressed tensor that a recomputed one's replay reads runs kept (plan P12); the episode's
    ``info["actions"]`` said compress, unlike the policy that ``Policy.from_vector`` makes of them (30 of 30 random
    episodes on resnet18, a QA run). Now the codes scored, which simulate to the episode's figures."""
    from runtime.policy import Policy, PolicyOptions
    from runtime.trace import capture
    from tests.test_trace import tiny_cnn_build

    w = capture(tiny_cnn_build(batch=4), name="cnn", batch_size=4)
    hw = get_profile("a100-40gb")
    env = MemoryPolicyEnv(workload=w, hardware=hw, budget_bytes=10**12, allow_compress=True)
    rng = np.random.default_rng(0)
    differed = 0
    for _ in range(20):
        asked = rng.choice([RECOMPUTE, COMPRESS], env.k).astype(np.int8)
        _, info = run_episode(env, asked)
        ran = Policy.from_vector(w, info["actions"], hardware=hw.name, options=PolicyOptions(lossy=True))
        assert np.array_equal(ran.to_vector(w), info["actions"])
        sim = Simulator(w, hw).run(info["actions"], options=env.problem.options)
        assert (sim.peak_bytes, sim.samples_per_s) == (info["peak_bytes"], info["samples_per_s"])
        differed += int(not np.array_equal(info["actions"], asked))
    assert differed  # some asked compressions ran kept


def test_swap_is_masked_where_the_problem_plans_it_as_keep() -> None:
    """On the cpu profile a swap is planned as the keep it becomes (simulator Rule 4): the mask offered it and
    the episode said swap was applied where keep was scored (its samples/s not ``Simulator.run``'s of
    ``info["actions"]`` in 20 of 20 random episodes on resnet18, a QA run)."""
    cpu = get_profile("cpu")
    env = MemoryPolicyEnv(workload=synthetic_workload(), hardware=cpu, budget_bytes=10**12)
    _, info = env.reset()
    assert not info["action_mask"][SWAP]
    _, info = run_episode(env, [SWAP] * env.k)
    assert info["applied_action"] == KEEP and not np.any(info["actions"] == SWAP)
    sim = Simulator(env.problem.workload, cpu).run(info["actions"])
    assert info["samples_per_s"] == sim.samples_per_s


def test_compress_is_masked_without_allow_compress_and_replaced_by_keep() -> None:
    env = MemoryPolicyEnv(workload=synthetic_workload())
    _, info = env.reset()
    assert np.array_equal(info["action_mask"], [True, True, True, False])
    masks = []
    for _ in range(env.k):
        masks.append(env.action_masks())
        _, _, terminated, _, info = env.step(COMPRESS)
        assert info["requested_action"] == COMPRESS and info["applied_action"] == KEEP
    assert terminated and not np.any(np.array(masks)[:, COMPRESS])
    assert np.array_equal(info["actions"], np.zeros(env.k, dtype=np.int8))
    assert info["peak_bytes"] == env.baseline.peak_bytes


def test_compress_needs_a_float_wider_than_the_compressed_dtype() -> None:
    """With allow_compress, float32 tensors can be compressed to bfloat16; the pooling's int64 indices
    cannot (and uint8 tensors of the chain neither)."""
    w = synthetic_workload()
    env = MemoryPolicyEnv(workload=w, allow_compress=True)
    env.reset()
    allowed = []
    for _ in w.candidates:
        allowed.append(bool(env.action_masks()[COMPRESS]))
        env.step(COMPRESS)
        assert env.actions[env.candidate - 1] == (COMPRESS if allowed[-1] else KEEP)
    assert allowed == [w.tensors[c.tensor].dtype == "float32" for c in w.candidates]
    assert allowed.count(False) == 1

    chain = chain_env(10 * S, allow_compress=True)
    _, info = chain.reset()
    assert not info["action_mask"][COMPRESS]


def test_out_of_range_actions_become_keep_and_masks_follow_the_candidate() -> None:
    env = chain_env(9 * S)
    _, info = env.reset()
    actions = [7, -1, np.int64(SWAP), np.array(RECOMPUTE), KEEP, KEEP, KEEP, KEEP]
    for a in actions:
        assert np.array_equal(info["action_mask"], env.action_masks())
        _, _, terminated, _, info = env.step(a)
    assert terminated
    assert info["actions"].tolist() == [KEEP, KEEP, SWAP, RECOMPUTE, KEEP, KEEP, KEEP, KEEP]
    assert np.array_equal(info["action_mask"], [True, False, False, False])  # nothing left to decide
    with pytest.raises(RuntimeError, match="reset"):
        env.step(KEEP)


def test_recompute_is_masked_where_a_closure_has_no_finite_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every candidate of a workload has a closure; were its time not finite, recompute would be masked."""

    def no_closure_for_candidate_2(sim: Simulator) -> Any:
        f = compute_features(sim)
        f = dataclasses.replace(f, recompute_s=f.recompute_s.copy())
        f.recompute_s[2] = np.inf
        return f

    env = MemoryPolicyEnv()
    assert env._masks[:, RECOMPUTE].all()
    monkeypatch.setattr(Simulator, "features", property(no_closure_for_candidate_2))
    env = MemoryPolicyEnv()
    obs, info = env.reset()
    for i in range(env.k):
        assert info["action_mask"][RECOMPUTE] == (i != 2)
        if i == 2:
            assert obs[OBS_FIELDS.index("recompute_time")] == 10.0  # the cap, not inf
        obs, _, _, _, info = env.step(RECOMPUTE)
        assert info["applied_action"] == (KEEP if i == 2 else RECOMPUTE)


# -- observations -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("allow_compress", [False, True])
def test_observations_stay_in_the_box_over_random_episodes(allow_compress: bool) -> None:
    problems = [
        MemoryPolicyEnv(allow_compress=allow_compress),
        MemoryPolicyEnv(workload=synthetic_workload(blocks=1), budget_bytes=1, allow_compress=allow_compress),
        chain_env(2 * S, n=16, allow_compress=allow_compress),
    ]
    assert OBS_SIZE == len(OBS_FIELDS) == 29
    for env in problems:
        space = env.observation_space
        assert space.shape == (OBS_SIZE,) and space.dtype == np.float32
        for episode in range(3):
            obs, info = env.reset(seed=episode)
            seen = [obs]
            terminated = False
            while not terminated:
                legal = np.flatnonzero(info["action_mask"])
                obs, _, terminated, _, info = env.step(int(env.np_random.choice(legal)))
                seen.append(obs)
            for o in seen:
                assert o.shape == (OBS_SIZE,) and o.dtype == np.float32
                assert np.all(np.isfinite(o)) and space.contains(o)
            assert seen[-1][OBS_FIELDS.index("done_fraction")] == 1.0
            assert not np.any(seen[-1][: OBS_FIELDS.index("peak_ratio")])  # no candidate left


def test_observation_tracks_the_partial_policy() -> None:
    env = chain_env(9 * S)
    obs, _ = env.reset()
    peak, left, done = (OBS_FIELDS.index(f) for f in ("peak_ratio", "remaining_ratio", "done_fraction"))
    assert obs[peak] == pytest.approx(10 / 9) and obs[left] == pytest.approx(8 / 9) and obs[done] == 0.0
    assert obs[OBS_FIELDS.index("byte_share")] == pytest.approx(1 / 8)
    assert obs[OBS_FIELDS.index("fwd_position")] == 0.0
    need = OBS_FIELDS.index("need_ratio")
    assert obs[need] == pytest.approx(1 / 8)  # one S over the budget, eight S still to decide
    assert obs[OBS_FIELDS.index("live_at_peak")] == 1.0  # every activation of the chain is live at its peak
    assert obs[OBS_FIELDS.index("size_rank")] == 0.0  # eight equal sizes share the lowest rank
    obs, *_ = env.step(RECOMPUTE)  # takes c_0 off the peak
    assert obs[peak] == pytest.approx(1.0) and obs[left] == pytest.approx(7 / 9) and obs[done] == 1 / 8
    assert obs[need] == 0.0  # it fits
    assert obs[OBS_FIELDS.index("recompute_share")] == 1.0 and obs[OBS_FIELDS.index("keep_share")] == 0.0
    obs, *_ = env.step(KEEP)
    assert obs[OBS_FIELDS.index("recompute_share")] == 0.5 and obs[OBS_FIELDS.index("keep_share")] == 0.5


def test_rank_fields_are_percentiles_among_the_candidates() -> None:
    """The synthetic CNN: its feature maps are its largest candidates, the log-probabilities its smallest."""
    env = MemoryPolicyEnv()
    size = env._features[:, OBS_FIELDS.index("size_rank")]
    nbytes = np.array([c.nbytes for c in env.problem.workload.candidates])
    n, ties = len(nbytes), int(np.sum(nbytes == nbytes.max()))  # equal sizes share the lowest rank
    assert size[np.argmax(nbytes)] == pytest.approx((n - ties) / (n - 1))
    assert size[np.argmin(nbytes)] == 0.0
    assert np.all(np.diff(size[np.argsort(nbytes, kind="stable")]) >= 0)  # ordered as the sizes are
    for name in ("recompute_rank", "swap_rank"):
        col = env._features[:, OBS_FIELDS.index(name)]
        assert col.min() == 0.0 and col.max() <= 1.0


def test_render_ansi_is_one_line() -> None:
    env = MemoryPolicyEnv(render_mode="ansi")
    env.reset()
    text = env.render()
    assert isinstance(text, str) and "\n" not in text and "candidate 0/9" in text
    assert MemoryPolicyEnv().render() is None
    with pytest.raises(ValueError, match="render_mode"):
        MemoryPolicyEnv(render_mode="human")


# -- determinism and the best policy ------------------------------------------------------------------------------
def test_same_seed_same_actions_same_trajectory() -> None:
    rng = np.random.default_rng(7)
    actions = rng.integers(0, 4, size=9).tolist()
    trajectories = []
    for _ in range(2):
        env = MemoryPolicyEnv(allow_compress=True)
        obs, _ = env.reset(seed=123)
        steps = [(obs, 0.0)]
        for a in actions:
            obs, reward, *_ = env.step(a)
            steps.append((obs, reward))
        trajectories.append(steps)
    for (o1, r1), (o2, r2) in zip(*trajectories, strict=True):
        assert np.array_equal(o1, o2) and r1 == r2


def test_best_is_the_best_feasible_policy_over_episodes() -> None:
    """Chain of 8 at a 9-tensor budget: recomputing c_0 fits at 16/17 of the throughput; swapping it fits
    for free (copies of 1 us hide under 1 ms ops); keep-all does not fit."""
    env = chain_env(9 * S)
    recompute, swap = np.zeros(env.k, dtype=np.int8), np.zeros(env.k, dtype=np.int8)
    recompute[0], swap[0] = RECOMPUTE, SWAP

    r1, info = run_episode(env, recompute)
    assert info["is_best"] and env.best is not None and np.array_equal(env.best.actions, recompute)
    r2, info = run_episode(env, swap)
    assert r2 == 1.0 > r1 and info["is_best"]
    r3, info = run_episode(env, np.zeros(env.k, dtype=np.int8))
    assert r3 < 0 and not info["is_best"]
    r4, info = run_episode(env, recompute)
    assert r4 == r1 and not info["is_best"]

    best = env.best
    assert best is not None and best.reward == 1.0 and best.episode == 2 and env.episodes == 4
    assert np.array_equal(best.actions, swap)
    again = Simulator(env.problem.workload, fixed_profile()).run(swap, budget_bytes=9 * S)
    assert best.result == again and best.measured is None


def test_constructor_rejects_contradictions() -> None:
    problem = Problem(chain_workload(4, S, TAU), fixed_profile(), budget_bytes=5 * S)
    with pytest.raises(ValueError, match="either problem"):
        MemoryPolicyEnv(problem, budget_bytes=S)
    with pytest.raises(ValueError, match="allow_compress"):
        MemoryPolicyEnv(problem, allow_compress=True)
    with pytest.raises(ValueError, match="real="):
        MemoryPolicyEnv(problem, backend="real")
    with pytest.raises(ValueError, match="backend"):
        MemoryPolicyEnv(problem, backend="gpu")


# -- the real backend ---------------------------------------------------------------------------------------------
def test_fake_real_backend_scores_measurements() -> None:
    """A stand-in ``real`` callable: the reward follows its numbers, each policy is measured once."""
    calls: list[list[int]] = []

    def real(actions: np.ndarray) -> tuple[int, float]:
        calls.append(actions.tolist())
        return (12 * S, 2.0) if not actions.any() else (8 * S, 2.5)

    env = chain_env(10 * S, backend="real", real=real)
    reward, info = run_episode(env, [SWAP] + [KEEP] * 7)
    assert reward == 2.0 / 2.5 and info["feasible"] and info["peak_bytes"] == 8 * S
    assert info["sim_peak_bytes"] == 9 * S  # the simulator's view, for comparison
    reward, info = run_episode(env, [KEEP] * 8)
    assert reward == -1 - (12 * S - 10 * S) / (10 * S) and not info["feasible"]
    run_episode(env, [SWAP] + [KEEP] * 7)
    assert len(calls) == 2  # keep-all and the swap policy, each measured once
    assert env.best is not None and env.best.measured == (8 * S, 2.5)


def deep_mlp(batch_size: int = 512, width: int = 128, depth: int = 6):  # type: ignore[no-untyped-def]
    """A ``build_model`` factory (``tests.test_env:deep_mlp``): Linear-ReLU layers whose activations, not
    their parameters, set the peak. (resnet18 at a size the CPU trains fast peaks in its parameter state:
    no policy changes that peak, so it could not show a policy at work.)"""
    import torch
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    x, y = torch.randn(batch_size, width), torch.randint(0, width, (batch_size,))
    return nn.Sequential(*layers), (x, y), _cross_entropy


def _cross_entropy(module, batch):  # type: ignore[no-untyped-def]
    from torch import nn

    return nn.functional.cross_entropy(module(batch[0]), batch[1])


def test_real_backend_trains_a_small_model_on_the_cpu() -> None:
    """Real iterations on the CPU: keep-all over a budget just under its measured peak pays the penalty
    computed by hand; recomputing every other ReLU output fits, as measured, with the peak the simulator
    predicted (swapping would not: on the CPU the host store is the same memory, and it is counted)."""
    backend = real_backend("tests.test_env:deep_mlp", 512, steps=1)
    w = backend.workload
    keep = np.zeros(len(w.candidates), dtype=np.int8)
    keep_peak, _ = backend(keep)
    budget = int(0.95 * keep_peak)
    hw = calibrate_cpu(0.2)
    env = MemoryPolicyEnv(workload=w, hardware=hw, budget_bytes=budget, backend="real", real=backend)

    reward, info = run_episode(env, keep)
    assert info["peak_bytes"] == keep_peak  # the CPU tracker's peak is deterministic
    assert reward == -1 - (keep_peak - budget) / budget and not info["feasible"]
    # The tracker counts what the trace counted (tests/test_apply.py: within 3%; here, exactly so far).
    assert info["sim_peak_bytes"] == pytest.approx(keep_peak, rel=0.03)
    keep_s = info["iter_s"]

    recompute = np.zeros(len(w.candidates), dtype=np.int8)
    recompute[[0, 2, 4]] = RECOMPUTE  # the outputs of the first, third and fifth ReLU
    reward, info = run_episode(env, recompute)
    assert info["feasible"] and info["peak_bytes"] < budget
    assert info["peak_bytes"] == pytest.approx(info["sim_peak_bytes"], rel=0.03)
    assert 0 < reward <= 1.0 and reward == min(1.0, keep_s / info["iter_s"])
    assert (
        env.best is not None and env.best.reward == reward and env.best.measured == (info["peak_bytes"], info["iter_s"])
    )
    assert env.best.result == Simulator(w, hw).run(recompute, budget_bytes=budget)


def test_real_backend_counts_a_run_the_allocator_made_room_for_as_no_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Measured search ]: steady iterations during which the caching allocator freed cached segments to
    make room within the cap (what CUDA's measurements count; none on the CPU) measure as an infinite time, not
    a fit; the same iterations without retries measure their median time."""
    import runtime.measure
    from runtime.measure import IterationMeasurement

    backend = real_backend("tests.test_env:deep_mlp", 512, steps=1)
    keep = np.zeros(len(backend.workload.candidates), dtype=np.int8)

    def steps(retries: int, freed: int) -> list[IterationMeasurement]:
        return [
            IterationMeasurement(1000, 0.02, 512 / 0.02, 2048, retries, freed),
            IterationMeasurement(900, 0.01, 512 / 0.01, 2048, 0, 0),
        ]

    for counts, expected in (((0, 0), (1000, 0.015)), ((1, 1), (1000, float("inf"))), ((0, 2), (1000, float("inf")))):
        monkeypatch.setattr(runtime.measure, "run_iterations", lambda *a, c=counts, **k: steps(*c))
        peak, iter_s = backend(keep)
        assert (peak, iter_s) == (expected[0], pytest.approx(expected[1]))
