"""A gymnasium environment that builds a keep / swap / recompute / compress policy one tensor at a time.

Registered as ``autotune/MemoryPolicy-v1`` (see ``envs/__init__.py``). The simulator (envs/simulator.py)
scores every finished policy, or, with ``backend="real"``, real training iterations do
(:func:`autotune.real_backend.real_backend`). The observation is a fixed-size vector, independent of the
model, so one network can serve many models.

The environment is built on :class:`envs.problem.Problem` (the searchers' problem extends it) and observes
the candidates' features (envs/features.py), the same the heuristics rank by. Without a problem it solves
the synthetic workload of runtime/synthetic.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from envs.features import OP_CLASSES
from envs.problem import Problem
from envs.simulator import SimResult
from runtime.hardware import HardwareProfile, get_profile
from runtime.synthetic import synthetic_workload
from runtime.vocab import ACTION_NAMES, COMPRESS, KEEP, N_ACTIONS, RECOMPUTE, SWAP, compressible
from runtime.workload import Workload

#: ``real(actions) -> (peak_bytes, iter_s)``: one finished policy (action codes over ``workload.candidates``)
#: measured by real training iterations. See :func:`autotune.real_backend.real_backend`.
RealMeasure = Callable[[np.ndarray], tuple[int, float]]


#: Hardware profile and budget (fraction of the no-policy peak) used when they are not given.
DEFAULT_HARDWARE = "a100-40gb"
DEFAULT_BUDGET_FRACTION = 0.6

# -- observation layout ------------------------------------------------------------------------------------
#: Features of the candidate to decide (all zero once every candidate is decided).
CANDIDATE_FIELDS: tuple[str, ...] = (
    "log2_bytes",  # log2(nbytes) / 40: 1.0 would be a 1 TiB tensor
    "byte_share",  # nbytes / total candidate bytes
    "recompute_time",  # recompute_s / no-policy iteration time
    "swap_hide_ratio",  # swap_out_s / idle_s, clipped to [0, 10]: > 1 cannot hide under compute
    "lifetime",  # idle_s / no-policy iteration time
    "fwd_position",  # producer op / number of forward ops
    "block_input",  # 1.0 for a block boundary (Candidate.block_input)
    *(f"class_{name}" for name in OP_CLASSES),  # one-hot op class of the producer (envs.features)
    # v1: where the candidate stands among this workload's candidates (0 = lowest), so that one network can
    # compare a candidate with the rest of any model, and whether dropping it can lower the no-policy peak.
    "live_at_peak",  # 1.0 when its storage is live at the no-policy peak op
    "size_rank",  # percentile of nbytes
    "recompute_rank",  # percentile of recompute time per byte (cheapest to recompute = 0)
    "swap_rank",  # percentile of swap_hide_ratio (easiest to hide = 0)
)
#: The policy so far: decided prefix as chosen, every candidate after it kept.
STATE_FIELDS: tuple[str, ...] = (
    "peak_ratio",  # simulated peak of the partial policy / budget, clipped to [0, 10]
    "remaining_ratio",  # candidate bytes still to decide (current one included) / budget, clipped to [0, 10]
    "done_fraction",  # candidates decided / candidates
    "keep_share",  # bytes decided keep / bytes decided (0 when nothing is decided yet)
    "swap_share",
    "recompute_share",
    "compress_share",
    "need_ratio",  # v1: (peak of the partial policy - budget) / candidate bytes still to decide, clipped to [0, 10]
)
OBS_FIELDS: tuple[str, ...] = (*CANDIDATE_FIELDS, *STATE_FIELDS)
#: Length of the observation vector (29 with envs.features' ten op classes).
OBS_SIZE = len(OBS_FIELDS)
_RATIO_CAP = 10.0  # ratios that can be large (times, peaks) are clipped here
_HIGH = {
    "log2_bytes": 2.0,
    "recompute_time": _RATIO_CAP,
    "swap_hide_ratio": _RATIO_CAP,
    "peak_ratio": _RATIO_CAP,
    "remaining_ratio": _RATIO_CAP,
    "need_ratio": _RATIO_CAP,
}
OBS_LOW = np.zeros(OBS_SIZE, dtype=np.float32)
OBS_HIGH = np.array([_HIGH.get(name, 1.0) for name in OBS_FIELDS], dtype=np.float32)
_N_CAND = len(CANDIDATE_FIELDS)


@dataclass
class BestPolicy:
    """The best feasible policy the environment has finished so far (what searchers read off ``env.best``).

    ``result`` is always the simulated result of ``actions`` under the problem's budget (so that a searcher
    can hand it on as its own); ``reward`` is the episode's reward, from the simulator or, with the real
    backend, from ``measured`` = (peak_bytes, iter_s) of real iterations."""

    actions: np.ndarray
    result: SimResult
    reward: float
    episode: int
    measured: tuple[int, float] | None = None


class MemoryPolicyEnv(gym.Env[np.ndarray, np.int64]):
    """
    ## Description

    Fit one training iteration into a GPU memory budget by deciding, for each activation autograd saves for
    backward (a *candidate*), whether to keep it on the device, swap it to host memory, recompute it in
    backward or compress it (lossy). An episode walks the candidates of one workload in
    ``workload.candidates`` order, which is execution order: :mod:`runtime.trace` records them in the order
    autograd first saves them during forward (by save op). Deciding early tensors first mirrors how memory
    builds up in forward, and the observation's running peak tells the agent what its prefix has bought.
    Each step decides one candidate; the finished policy is scored by the simulator
    (``envs/simulator.py``), or with ``backend="real"`` by real training iterations.

    ## Action Space

    ``Discrete(4)``: 0 keep, 1 swap, 2 recompute, 3 compress (``envs.simulator.KEEP`` ... ``COMPRESS``).
    :meth:`action_masks` returns the legal actions for the current candidate as a bool array of length 4
    (sb3-contrib's ``MaskablePPO`` convention); the same mask is in ``info["action_mask"]`` after ``reset`` and
    every ``step``. Keep is always legal, swap where the problem allows it (``Problem.allow_swap``: not on a profile
    without copy engines, the CPU, nor for compiled training). Recompute is legal when the candidate has a finite
    recompute closure time (always, for traced workloads). Compress is legal only with ``allow_compress`` and a
    floating-point tensor wider than ``options.compress_dtype`` (float32 or float64 for the default bfloat16). **An
    illegal action, or a value outside 0..3, is replaced by keep** (never an error); the action actually applied is
    ``info["applied_action"]``.

    ## Observation Space

    ``Box(0, high, (OBS_SIZE,), float32)`` with ``OBS_SIZE`` = 29, the same for every model (fields named in
    ``OBS_FIELDS``; times are relative to the no-policy iteration time, bytes to the budget, ranks are
    percentiles among the workload's candidates):

    | index | field           | meaning                                                            | range   |
    |-------|-----------------|--------------------------------------------------------------------|---------|
    | 0     | log2_bytes      | log2(nbytes) / 40 of the current candidate                         | [0, 2]  |
    | 1     | byte_share      | nbytes / total candidate bytes                                     | [0, 1]  |
    | 2     | recompute_time  | recompute closure time / no-policy iteration time                  | [0, 10] |
    | 3     | swap_hide_ratio | copy-out time / idle time until its first backward use             | [0, 10] |
    | 4     | lifetime        | idle time / no-policy iteration time                               | [0, 1]  |
    | 5     | fwd_position    | producer op / number of forward ops                                | [0, 1]  |
    | 6     | block_input     | 1 for a block boundary                                             | {0, 1}  |
    | 7-16  | class_*         | one-hot op class of the producer (``envs.features.OP_CLASSES``)  | {0, 1}  |
    | 17    | live_at_peak    | 1 when the candidate is live at the no-policy peak op              | {0, 1}  |
    | 18    | size_rank       | percentile of its bytes                                            | [0, 1]  |
    | 19    | recompute_rank  | percentile of its recompute time per byte                          | [0, 1]  |
    | 20    | swap_rank       | percentile of its swap_hide_ratio                                  | [0, 1]  |
    | 21    | peak_ratio      | simulated peak of the partial policy / budget                      | [0, 10] |
    | 22    | remaining_ratio | candidate bytes still to decide / budget                           | [0, 10] |
    | 23    | done_fraction   | candidates decided / candidates                                    | [0, 1]  |
    | 24-27 | *_share         | decided bytes per action (keep, swap, recompute, compress) / bytes decided | [0, 1] |
    | 28    | need_ratio      | (partial peak - budget) / candidate bytes still to decide; 0 once it fits  | [0, 10] |

    The partial policy is the decided prefix as chosen with every later candidate kept; its peak is
    re-simulated only after a non-keep action (a keep changes nothing). After the last step the candidate
    fields are zero.

    ## Rewards

    0 on every step but the last. The last step scores the finished policy: if its peak fits the budget,
    ``samples_per_s / no_policy_samples_per_s`` (the no-policy throughput is keep-all's, so this is in
    (0, 1] and exactly 1.0 for keep-all); otherwise ``-1 - (peak - budget) / budget``, a penalty that grows
    with the excess. With ``backend="real"`` peak and time are measured, and the ratio is capped at 1
    (measurement noise can make a policy look faster than keep-all).

    ## Starting State

    Every candidate undecided (kept); the first candidate to decide. The environment is deterministic: the
    seed of ``reset(seed=...)`` only seeds ``env.np_random`` for callers that draw from it.

    ## Episode End

    The episode terminates after one action per candidate (``len(workload.candidates)`` steps); it is never
    truncated. The last step's ``info`` holds ``peak_bytes``, ``iter_s``, ``samples_per_s``, ``feasible``,
    ``reward`` and ``actions`` (the codes scored: illegal choices replaced by keep, and so is a compressed
    tensor that a recomputed one's replay reads, as the runtime runs it: runtime/plan.py P12), and,
    with the real backend, ``sim_peak_bytes`` and ``sim_samples_per_s``. The best feasible policy over all
    episodes is kept in ``env.best`` (:class:`BestPolicy`, ``None`` until one fits).

    ## Arguments

    ```python
    import gymnasium as gym
    import envs  # registers the id

    env = gym.make("autotune/MemoryPolicy-v1")  # a small synthetic CNN on a100-40gb, budget 60% of its peak
    env = gym.make("autotune/MemoryPolicy-v1", problem=Problem(workload, get_profile("h100-80gb"), budget))
    env = MemoryPolicyEnv(workload=w, hardware=hw, budget_bytes=b, allow_compress=True)
    ```

    * ``problem``: the :class:`~agents.base.Problem` to solve (workload, hardware, budget, options,
      allow_compress). Every simulation goes through ``problem.evaluate``, so ``problem.evaluations`` counts
      them. Give either a problem or the three arguments below.
    * ``workload``, ``hardware``, ``budget_bytes``: a problem by parts; each one missing gets a default
      (:func:`runtime.synthetic.synthetic_workload`, ``DEFAULT_HARDWARE``, ``DEFAULT_BUDGET_FRACTION`` of the
      no-policy peak).
    * ``allow_compress``: allow the lossy compress action (with ``problem``, set it on the problem instead).
    * ``backend``: ``"sim"`` (default) or ``"real"``: who scores finished policies.
    * ``real``: with ``backend="real"``, a callable ``real(actions) -> (peak_bytes, iter_s)`` that runs real
      training iterations under the policy ``actions`` (int8 codes over ``workload.candidates``) and returns
      their peak device memory in bytes and seconds per iteration (see
      :func:`autotune.real_backend.real_backend`). It is called once for keep-all (the throughput
      reference) and once per distinct finished policy (cached). Apply the problem's ``options`` there too.
      Intermediate peaks still come from the simulator.
    * ``render_mode``: ``None`` or ``"ansi"`` (``render()`` returns a one-line summary).

    ## Version History

    * v1: ``live_at_peak``, ``size_rank``, ``recompute_rank``, ``swap_rank`` and ``need_ratio`` added (29
      fields), so that one network can place a candidate among the rest of any model (agents/pretrained.py).
    * v0: initial version (24 fields).
    """

    # A plain class attribute, as gymnasium.Env declares it (ClassVar would clash with the base class).
    metadata = {"render_modes": ["ansi"], "render_fps": 4}  # noqa: RUF012

    def __init__(
        self,
        problem: Problem | None = None,
        *,
        workload: Workload | None = None,
        hardware: HardwareProfile | None = None,
        budget_bytes: int | None = None,
        allow_compress: bool = False,
        backend: str = "sim",
        real: RealMeasure | None = None,
        render_mode: str | None = None,
    ) -> None:
        super().__init__()
        if problem is None:
            problem = _default_problem(workload, hardware, budget_bytes, allow_compress)
        elif workload is not None or hardware is not None or budget_bytes is not None:
            raise ValueError("give either problem or workload/hardware/budget_bytes, not both")
        elif allow_compress and not problem.allow_compress:
            raise ValueError("allow_compress=True with a Problem that forbids it: set problem.allow_compress")
        if problem.budget_bytes <= 0:
            raise ValueError(f"budget_bytes={problem.budget_bytes}: expected a positive number of bytes")
        if problem.n == 0:
            raise ValueError(f"workload {problem.workload.model!r} has no candidates: there is nothing to decide")
        if backend not in ("sim", "real"):
            raise ValueError(f"backend={backend!r}: expected 'sim' or 'real'")
        if backend == "real" and real is None:
            raise ValueError(
                "backend='real' needs real=callable(actions) -> (peak_bytes, iter_s); "
                "see autotune.real_backend.real_backend()"
            )
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode={render_mode!r}: expected None or one of {self.metadata['render_modes']}")
        self.problem = problem
        self.backend = backend
        self.real = real
        self.render_mode = render_mode
        self.action_space = spaces.Discrete(N_ACTIONS)
        self.observation_space = spaces.Box(OBS_LOW, OBS_HIGH, dtype=np.float32)

        w = problem.workload
        self.k = problem.n
        self.budget_bytes = int(problem.budget_bytes)
        self.baseline: SimResult = problem.evaluate(problem.keep_all())  # no policy: the throughput reference
        self._nbytes = np.array([c.nbytes for c in w.candidates], dtype=np.float64)
        self._total_bytes = float(self._nbytes.sum())
        self._to_place = np.append(np.cumsum(self._nbytes[::-1])[::-1], 0.0)  # bytes from candidate i on
        self._features = self._candidate_table()
        self._masks = self._mask_table()
        self._measured: dict[bytes, tuple[int, float]] = {}  # real backend: finished policy -> measurement
        self.best: BestPolicy | None = None
        self.episodes = 0  # finished episodes
        self._reset_state()

    # -- static tables ---------------------------------------------------------------------------------------
    def _candidate_table(self) -> np.ndarray:
        """The candidate fields of the observation, one row per candidate: static, so computed once."""
        feats = self.problem.simulator.features
        iter_s = max(self.baseline.iter_s, 1e-30)
        table = np.zeros((self.k, _N_CAND), dtype=np.float64)
        table[:, 0] = np.log2(np.maximum(self._nbytes, 1.0)) / 40.0
        table[:, 1] = self._nbytes / max(self._total_bytes, 1.0)
        table[:, 2] = np.where(np.isfinite(feats.recompute_s), feats.recompute_s / iter_s, _RATIO_CAP)
        # A copy that takes longer than the window it could hide in stalls; no window at all: worst case.
        with np.errstate(divide="ignore", invalid="ignore"):
            hide = np.where(feats.idle_s > 0, feats.swap_out_s / feats.idle_s, np.inf)
        table[:, 3] = np.where(feats.swap_out_s > 0, hide, 0.0)
        table[:, 4] = feats.idle_s / iter_s
        table[:, 5] = feats.fwd_position
        table[:, 6] = feats.block_input
        for i, name in enumerate(feats.producer_class):
            table[i, 7 + OP_CLASSES.index(name)] = 1.0
        ranks = 7 + len(OP_CLASSES)
        w, peak_op = self.problem.workload, self.baseline.peak_op
        n_ops = len(w.ops)
        for i, c in enumerate(w.candidates):
            t = w.tensors[c.tensor]
            end = n_ops if t.free_op is None else t.free_op
            table[i, ranks] = float(max(t.alloc_op, 0) <= peak_op <= end)
        with np.errstate(divide="ignore", invalid="ignore"):
            per_byte = np.where(np.isfinite(feats.recompute_s), feats.recompute_s / np.maximum(self._nbytes, 1), np.inf)
        table[:, ranks + 1] = _percentile(self._nbytes)
        table[:, ranks + 2] = _percentile(per_byte)
        hide_ratio = np.where(feats.swap_out_s > 0, hide, 0.0)
        table[:, ranks + 3] = _percentile(np.nan_to_num(hide_ratio, nan=np.inf))
        table = np.nan_to_num(table, nan=0.0, posinf=_RATIO_CAP, neginf=0.0)
        return np.clip(table, OBS_LOW[:_N_CAND], OBS_HIGH[:_N_CAND])

    def _mask_table(self) -> np.ndarray:
        """Legal actions per candidate (see the class docstring, Action Space)."""
        w, problem = self.problem.workload, self.problem
        feats = problem.simulator.features
        masks = np.zeros((self.k, N_ACTIONS), dtype=bool)
        masks[:, KEEP] = True
        # Not where the problem plans a swap as the keep it becomes (the CPU, compiled training): the episode
        # said swap was applied where keep was scored (a QA run).
        masks[:, SWAP] = problem.allow_swap
        masks[:, RECOMPUTE] = np.isfinite(feats.recompute_s)
        if problem.allow_compress:
            # A cast to a dtype as wide saves nothing (Rule 8: the size ratio is at least 1).
            target = problem.options.compress_dtype
            masks[:, COMPRESS] = [compressible(w.tensors[c.tensor].dtype, target) for c in w.candidates]
        return masks

    # -- gymnasium API ---------------------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start a new episode. ``seed`` seeds ``self.np_random`` only (the environment is deterministic);
        ``options`` is accepted and ignored."""
        super().reset(seed=seed)
        self._reset_state()
        return self._observation(), {"action_mask": self.action_masks(), "candidate": 0}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._t >= self.k:
            raise RuntimeError("the episode is over: call reset() before step()")
        t = self._t
        requested = _as_code(action)
        applied = requested if requested is not None and self._masks[t, requested] else KEEP
        self._actions[t] = applied
        self._decided_bytes[applied] += self._nbytes[t]
        if applied != KEEP:  # a keep leaves the partial policy (the rest is kept) unchanged
            self._partial = self.problem.evaluate(self._actions)
        self._t += 1
        info: dict[str, Any] = {
            "candidate": t,
            "requested_action": -1 if requested is None else requested,
            "applied_action": applied,
        }
        reward = 0.0
        terminated = self._t == self.k
        if terminated:
            reward, final = self._finish()
            info.update(final)
        info["action_mask"] = self.action_masks()
        return self._observation(), reward, terminated, False, info

    def action_masks(self) -> np.ndarray:
        """Legal actions for the current candidate, bool of length 4 (keep only once the episode is over)."""
        if self._t >= self.k:
            return np.array([True, False, False, False])
        return self._masks[self._t].copy()

    def render(self) -> str | None:
        """``"ansi"``: one line (current candidate, partial peak against the budget, actions so far)."""
        if self.render_mode != "ansi":
            return None
        counts = " ".join(f"{name} {int(np.sum(self._actions[: self._t] == i))}" for i, name in enumerate(ACTION_NAMES))
        head = (
            f"candidate {self._t}/{self.k} {self.problem.workload.candidates[self._t].key!r}"
            if self._t < self.k
            else f"done {self.k}/{self.k}"
        )
        return (
            f"{head}: peak {self._partial.peak_bytes / 2**20:.1f} MiB of budget {self.budget_bytes / 2**20:.1f} MiB "
            f"({self._partial.peak_bytes / self.budget_bytes:.2f}x); decided {counts}"
        )

    # -- state -----------------------------------------------------------------------------------------------
    @property
    def actions(self) -> np.ndarray:
        """A copy of the current action vector (undecided candidates are kept)."""
        return self._actions.copy()

    @property
    def result(self) -> SimResult:
        """The simulated result of the current policy: the decided prefix, every later candidate kept (after
        the last step, the finished policy's)."""
        return self._partial

    @property
    def candidate(self) -> int:
        """Index into ``workload.candidates`` of the candidate the next action decides (``k`` when done)."""
        return self._t

    def _reset_state(self) -> None:
        self._t = 0
        self._actions = self.problem.keep_all()
        self._decided_bytes = np.zeros(N_ACTIONS, dtype=np.float64)
        self._partial = self.baseline  # simulated result of the partial policy (the rest kept)

    def _observation(self) -> np.ndarray:
        obs = np.zeros(OBS_SIZE, dtype=np.float64)
        if self._t < self.k:
            obs[:_N_CAND] = self._features[self._t]
        budget = float(self.budget_bytes)
        decided = float(self._decided_bytes.sum())
        obs[_N_CAND] = self._partial.peak_bytes / budget
        obs[_N_CAND + 1] = self._to_place[self._t] / budget
        obs[_N_CAND + 2] = self._t / self.k
        if decided > 0:
            obs[_N_CAND + 3 : _N_CAND + 7] = self._decided_bytes / decided
        left = self._to_place[self._t]
        excess = self._partial.peak_bytes - budget
        obs[_N_CAND + 7] = 0.0 if excess <= 0 else (excess / left if left > 0 else _RATIO_CAP)
        obs = np.nan_to_num(obs, nan=0.0, posinf=_RATIO_CAP, neginf=0.0)
        return np.clip(obs, OBS_LOW, OBS_HIGH).astype(np.float32)

    def _finish(self) -> tuple[float, dict[str, Any]]:
        """Reward and info of the finished policy; updates ``best``."""
        actions = self._actions.copy()
        sim = self._partial  # the partial policy with nothing left to decide is the finished one
        measured: tuple[int, float] | None = None
        if self.backend == "real":
            peak, iter_s = measured = self._measure(actions)
            base_iter_s = self._measure(self.problem.keep_all())[1]
            samples_per_s = self.problem.workload.batch_size / iter_s
            feasible = peak <= self.budget_bytes
            speed = min(1.0, base_iter_s / iter_s)
        else:
            peak, iter_s, samples_per_s, feasible = sim.peak_bytes, sim.iter_s, sim.samples_per_s, sim.feasible
            speed = samples_per_s / self.baseline.samples_per_s
        reward = float(speed) if feasible else -1.0 - (peak - self.budget_bytes) / self.budget_bytes
        self.episodes += 1
        improved = feasible and (self.best is None or reward > self.best.reward)
        if improved:
            self.best = BestPolicy(actions.copy(), sim, reward, self.episodes, measured)
        info: dict[str, Any] = {
            "peak_bytes": int(peak),
            "iter_s": float(iter_s),
            "samples_per_s": float(samples_per_s),
            "feasible": bool(feasible),
            "reward": reward,
            # What was scored: a compressed tensor a replay reads runs kept (plan P12), as a swap where the problem
            # plans it as keep (the env said compress where keep ran: a QA run).
            "actions": self.problem.simulator.as_run(self.problem.allowed(actions), self.problem.options),
            "is_best": bool(improved),
        }
        if self.backend == "real":
            info["sim_peak_bytes"] = sim.peak_bytes
            info["sim_samples_per_s"] = sim.samples_per_s
        return reward, info

    def _measure(self, actions: np.ndarray) -> tuple[int, float]:
        key = actions.tobytes()
        if key not in self._measured:
            assert self.real is not None
            peak, iter_s = self.real(actions.copy())
            if not (iter_s > 0):  # NaN included
                raise ValueError(f"real backend returned iter_s={iter_s!r}: expected a positive number of seconds")
            self._measured[key] = (int(peak), float(iter_s))
        return self._measured[key]


def _percentile(values: np.ndarray) -> np.ndarray:
    """Each value's rank among ``values`` as a fraction in [0, 1] (ties share their lowest rank; one value: 0)."""
    n = len(values)
    if n <= 1:
        return np.zeros(n)
    return np.searchsorted(np.sort(values), values, side="left") / (n - 1)


def _as_code(action: Any) -> int | None:
    """The action as an int in 0..3, or None for anything else (which ``step`` replaces by keep)."""
    try:
        code = int(np.asarray(action).reshape(()))
    except (TypeError, ValueError):
        return None
    return code if 0 <= code < N_ACTIONS else None


class PartitionChoiceEnv(gym.Env[np.ndarray, np.int64]):
    """
    ## Description

    :class:`MemoryPolicyEnv` over the same model traced with different partitions (runtime/partition.py; one
    may be none): NOTE [ Choosing a partition ] C5 in autotune/partitions.py. An episode's first step chooses
    the partition; the steps after it decide that partition's candidates, one each, as
    :class:`MemoryPolicyEnv` does, and the last is scored by the simulator.

    ## Action Space

    ``Discrete(4)``, as :class:`MemoryPolicyEnv`. At the first step, action ``i`` takes ``problems[i]``:
    :meth:`action_masks` allows those whose floor (``envs.simulator.peak_floor``, what no policy of that
    partition goes below) is within the budget, every one where none is; an illegal choice takes the first legal
    one. After it, the chosen environment's actions and masks.

    ## Observation Space

    :class:`MemoryPolicyEnv`'s. At the first step every field is zero (a candidate's are never all zero: its
    bytes are not), then the chosen environment's observations.

    ## Rewards

    0 on every step but the last. The last: the chosen environment's, its throughput taken relative to the
    fastest of the problems' no-policy iterations (a partition's keep-all is slower than another's: each
    environment's own reference would make their rewards incomparable); the over-budget penalty as it is.

    ## Episode End

    After the chosen problem's last candidate. ``info["rival"]``: the problem chosen, as
    :class:`agents.base.Proposal` names it (-1 the first, else the index among the others). ``best`` and
    ``best_rival``: the fastest feasible policy over every episode and its problem.

    ## Arguments

    * ``problems``: at most 4, one model's each (the same budget, hardware and options), the first the one a
      caller calls its own.
    """

    metadata = {"render_modes": [], "render_fps": 4}  # noqa: RUF012

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__()
        from envs.simulator import peak_floor

        if not 1 <= len(problems) <= N_ACTIONS:
            raise ValueError(f"{len(problems)} problems: expected 1 to {N_ACTIONS}, one per action of the first step")
        self.envs = [MemoryPolicyEnv(p, allow_compress=p.allow_compress) for p in problems]
        self.action_space = spaces.Discrete(N_ACTIONS)
        self.observation_space = spaces.Box(OBS_LOW, OBS_HIGH, dtype=np.float32)
        within = [peak_floor(p.workload, p.hardware).bytes <= p.budget_bytes for p in problems]
        self._choices = np.zeros(N_ACTIONS, dtype=bool)
        self._choices[: len(problems)] = within if any(within) else True
        self._fastest = max(e.baseline.samples_per_s for e in self.envs)
        self.chosen: int | None = None
        self.best: BestPolicy | None = None
        self.best_rival = -1
        self.episodes = 0

    @property
    def k(self) -> int:
        """The most steps an episode takes: the first, then the largest problem's candidates."""
        return 1 + max(e.k for e in self.envs)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """A new episode, at the partition's choice. ``seed`` seeds ``self.np_random`` only; ``options`` ignored."""
        super().reset(seed=seed)
        self.chosen = None
        return np.zeros(OBS_SIZE, dtype=np.float32), {"action_mask": self.action_masks(), "candidate": -1}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.chosen is None:
            requested = _as_code(action)
            legal = requested is not None and self._choices[requested]
            self.chosen = requested if legal and requested is not None else int(np.argmax(self._choices))
            obs, info = self.envs[self.chosen].reset()
            info = {**info, "requested_action": -1 if requested is None else requested,
                    "applied_action": self.chosen, "rival": self.chosen - 1}  # fmt: skip
            return obs, 0.0, False, False, info
        env = self.envs[self.chosen]
        obs, reward, terminated, truncated, info = env.step(action)
        info["rival"] = self.chosen - 1
        if terminated:
            self.episodes += 1
            if info["feasible"]:  # relative to the fastest keep-all of all the problems
                reward = float(info["samples_per_s"] / self._fastest) if self._fastest > 0 else reward
                info["reward"] = reward
            last = env.best  # feasible, as every best is: the faster one is better
            top = 0.0 if self.best is None else self.best.result.samples_per_s
            faster = last is not None and (self.best is None or last.result.samples_per_s > top)
            if info.get("is_best") and faster:
                self.best, self.best_rival = last, self.chosen - 1
        return obs, reward, terminated, truncated, info

    def action_masks(self) -> np.ndarray:
        """At the first step, the problems that can be chosen; then the chosen environment's legal actions."""
        return self._choices.copy() if self.chosen is None else self.envs[self.chosen].action_masks()


# -- the default problem --------------------------------------------------------------------------------------
def _default_problem(
    workload: Workload | None, hardware: HardwareProfile | None, budget_bytes: int | None, allow_compress: bool
) -> Problem:
    w = workload if workload is not None else synthetic_workload()
    hw = hardware if hardware is not None else get_profile(DEFAULT_HARDWARE)
    problem = Problem(w, hw, budget_bytes=0, allow_compress=allow_compress)
    if budget_bytes is None:
        budget_bytes = int(DEFAULT_BUDGET_FRACTION * problem.simulator.run(problem.keep_all()).peak_bytes)
    problem.budget_bytes = int(budget_bytes)
    return problem


__all__ = [
    "OBS_FIELDS",
    "OBS_SIZE",
    "BestPolicy",
    "MemoryPolicyEnv",
    "PartitionChoiceEnv",
    "RealMeasure",
]
