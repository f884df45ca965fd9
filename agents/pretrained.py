"""The pretrained agent: one network, trained across many models, that proposes a policy for any model.

``--searcher ppo-onepass`` runs one pass of the agent: a masked, deterministic rollout of its policy
network on :class:`~envs.memory_env.MemoryPolicyEnv` (the observation is model-independent, so one network
serves every model), then a budget-aware decoding of the same network's scores (NOTE [ One pass ]).
``--searcher ppo-pretrained`` is the one pass followed by Optuna refinement: TPE warm-started from the
agent's policy (and any seeds the caller passes), then per-tensor refinement and perturbation, as in the
portfolio (agents/portfolio.py), within the time budget.

The network is the actor of a MaskablePPO ``MlpPolicy`` (sb3-contrib): hidden tanh layers, then a linear
head to one logit per action. It ships as ``agents/data/ppo_pretrained.pt``, written by
``experiments/train_agent.py`` (behaviour cloning of the portfolio's policies on training workloads, then
optional MaskablePPO fine-tuning; see that script to retrain). The file holds tensors, strings and numbers
only and is read with ``torch.load(weights_only=True)``: PyTorch's restricted unpickler, which refuses
arbitrary objects, so a file from elsewhere cannot run code. It also records the observation layout it was
trained on; a file whose layout differs from ``envs.memory_env.OBS_FIELDS`` is refused. Inference is
NumPy (a few thousand multiply-adds per candidate), so a pass costs the simulations, not the network.

NOTE [ One pass ]
    1. Rollout: at each candidate, the legal action with the highest logit (``action_masks()``), as
       ``MaskablePPO.predict(deterministic=True)`` would choose. The environment re-simulates the partial
       policy after every non-keep action, so the network sees what its prefix bought.
    2. Fit: if the rollout's policy is over budget, the kept candidates are dropped in order of how much the
       network preferred dropping them (best legal non-keep logit less the keep logit, highest first), each
       with its best non-keep action, each kept only if it lowers the peak, until the policy fits. If not:
       the nearest prefetch look-ahead that fits (or lowers the peak most), then swaps turned into
       recomputes in the same order (a recomputed tensor holds no memory until its backward use). If the
       rollout's policy still does not fit, the same from keep-all, and the better of the two stands. If
       neither fits, the frugal ends (``_frugal``): every candidate dropped with the network's first drop, and
       the uniform policies that hold least (recompute everything, every block's inside, swap everything),
       each under every look-ahead; the fastest that fits (or the one holding least) goes on to step 3, and
       step 4 gives back from it. (On the training cells the two fits left 9 of 120 cells without a fitting
       policy, all at 20-30% budgets where a heuristic fits; with the frugal ends, none.)
    3. Look-ahead: the prefetch distance (``PolicyOptions.prefetch_lookahead``, one of agents.rule's
       ``LOOKAHEADS``) under which the fitting policy runs fastest; it decides how much of a swap's copy-in
       hides, so the same actions can differ by 15% in speed (every heuristic that swaps chooses it too).
    4. Give back, second choice: if it fits, a sweep over its non-keep decisions in the opposite order
       (least preferred first): each goes back to keep if the policy still fits and runs no slower, else
       to the network's second-ranked drop (swap for recompute or back) if that fits and runs faster. When
       the sweep changed anything, step 3 once more (the swaps left may hide best at another distance) and
       another sweep, up to ``SWEEPS`` in all: a switch later in the sweep, or the distance chosen again,
       can let a decision that could not go back before go back now (on the training cells of
       experiments/train_agent.py: 97 of 116 cells at the best heuristic's speed or above with one sweep, 99
       with four).
    5. Exchange: step 4 moves one decision at a time, so it cannot trade one drop for others (VGG-16 at 80% on
       a100-40gb: ``features.3``'s ReLU output recomputed, where recomputing ``features.4``'s and
       ``features.9``'s, cheaper to make, runs faster). Each of the ``EXCHANGE_GIVE`` decisions the network
       least preferred goes back to keep, and the policy is fitted again as in step 2 from the
       ``EXCHANGE_TAKE`` kept candidates it most prefers to drop; the trade stays where it fits and runs
       faster, then step 3 once more.
    6. Consolidate: the converse of step 5, which cannot trade several drops for one. Each of the ``EXCHANGE_TAKE``
       kept candidates the network most prefers to drop is dropped (its best drop), then the ``EXCHANGE_GIVE``
       decisions it least preferred go back to keep in turn, each where the policy still fits; the trade stays where
       it runs faster, then step 3 once more. On the training cells of experiments/train_agent.py it changes 23 of
       116 and slows none; the cells at the best heuristic's speed or above go from 106 to 108 (ResNet-18 at 75% on
       v100-16gb: 0.980 of the best heuristic's speed before it, 0.996 after; the agent before this one: 92 to 98).
    Each step of 2 and 4 is one simulation, so a pass costs at most about 2 + 2 x ``SWEEPS`` simulations per
    candidate, and steps 5 and 6 at most ``EXCHANGE_GIVE`` x (1 + ``EXCHANGE_TAKE``) and ``EXCHANGE_TAKE`` x (1 +
    ``EXCHANGE_GIVE``) in all (about a second at most for ResNet-101's 417 candidates; ``STAGES`` names the steps,
    and experiments/train_agent.py measures each one's share). Deterministic: no sampling anywhere.
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agents.base import Problem, Proposal, SearchContext, Searcher, better, register
from agents.optuna_search import OptunaSearcher, OptunaTPE
from agents.portfolio import Portfolio, Seeds
from agents.refine import fastest_lookahead
from agents.rule import LOOKAHEADS
from envs.simulator import SimResult, frugal_starts
from runtime.errors import AutotuneError
from runtime.fileio import atomic_write
from runtime.policy import PolicyOptions
from runtime.vocab import KEEP, RECOMPUTE, SWAP

#: The shipped agent (see experiments/train_agent.py to retrain it).
AGENT_PATH = Path(__file__).with_name("data") / "ppo_pretrained.pt"
FORMAT = 1
ACTIVATIONS = ("tanh", "relu")


@dataclass
class Agent:
    """A policy network as NumPy arrays: ``hidden`` (weight, bias) pairs with ``activation`` between them,
    then ``head`` to one logit per action. ``meta`` is what the training script recorded (strings, numbers
    and lists: the training and held-out workloads, the date, the command)."""

    hidden: list[tuple[np.ndarray, np.ndarray]]
    head: tuple[np.ndarray, np.ndarray]
    obs_fields: tuple[str, ...]
    activation: str = "tanh"
    meta: dict[str, Any] = field(default_factory=dict)

    def logits(self, obs: np.ndarray) -> np.ndarray:
        """One logit per action for one observation (or a batch of them, one per row)."""
        x = np.asarray(obs, dtype=np.float32)
        for w, b in self.hidden:
            x = x @ w.T + b
            x = np.tanh(x) if self.activation == "tanh" else np.maximum(x, 0.0)
        w, b = self.head
        return np.asarray(x @ w.T + b)

    # -- files ------------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What :func:`save_agent` writes: tensors, strings, numbers and lists only."""
        import torch

        tensors: dict[str, Any] = {}
        for i, (w, b) in enumerate(self.hidden):
            tensors[f"hidden.{i}.weight"] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
            tensors[f"hidden.{i}.bias"] = torch.from_numpy(np.ascontiguousarray(b, dtype=np.float32))
        tensors["head.weight"] = torch.from_numpy(np.ascontiguousarray(self.head[0], dtype=np.float32))
        tensors["head.bias"] = torch.from_numpy(np.ascontiguousarray(self.head[1], dtype=np.float32))
        return {
            "format": FORMAT,
            "obs_fields": list(self.obs_fields),
            "activation": self.activation,
            "layers": len(self.hidden),
            "state_dict": tensors,
            "meta": json.loads(json.dumps(self.meta, default=str)),  # plain types only (weights_only reads them)
        }

    @classmethod
    def from_state(cls, state: Any, source: str = "<state>") -> Agent:
        """Check a loaded state (:meth:`state`'s layout) and build the agent; AutotuneError on anything else."""
        from envs.memory_env import OBS_FIELDS
        from runtime.vocab import N_ACTIONS

        def bad(why: str) -> AutotuneError:
            return AutotuneError(f"'{source}' is not a usable autotune agent: {why}; {_RETRAIN}")

        if not isinstance(state, dict) or state.get("format") != FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise bad(f"format {found!r}, expected {FORMAT}")
        fields = tuple(state.get("obs_fields") or ())
        if fields != OBS_FIELDS:
            raise bad(
                f"it was trained on observations of {len(fields)} fields, this environment has {len(OBS_FIELDS)} "
                f"({', '.join(sorted(set(fields) ^ set(OBS_FIELDS))) or 'same fields, another order'} differ)"
            )
        activation = state.get("activation")
        if activation not in ACTIVATIONS:
            raise bad(f"activation {activation!r}, expected one of {', '.join(ACTIVATIONS)}")
        tensors = state.get("state_dict")
        layers = state.get("layers")
        if not isinstance(tensors, dict) or not isinstance(layers, int) or layers < 0:
            raise bad("no state_dict or layer count")

        def array(key: str, ndim: int) -> np.ndarray:
            t = tensors.get(key)
            if t is None or not hasattr(t, "numpy"):
                raise bad(f"tensor {key!r} is missing")
            a = t.detach().cpu().float().numpy()
            if a.ndim != ndim or not np.all(np.isfinite(a)):
                raise bad(f"tensor {key!r} has shape {tuple(a.shape)} or non-finite values")
            return a

        hidden = [(array(f"hidden.{i}.weight", 2), array(f"hidden.{i}.bias", 1)) for i in range(layers)]
        head = (array("head.weight", 2), array("head.bias", 1))
        width = len(OBS_FIELDS)
        for w, b in [*hidden, head]:
            if w.shape[1] != width or w.shape[0] != len(b):
                raise bad(f"layer shapes do not chain: {tuple(w.shape)} after width {width}")
            width = w.shape[0]
        if width != N_ACTIONS:
            raise bad(f"the head has {width} outputs, expected {N_ACTIONS} actions")
        meta = state.get("meta")
        return cls(hidden, head, fields, activation, meta if isinstance(meta, dict) else {})


_RETRAIN = "retrain it with `python experiments/train_agent.py` (see its --help)"


def save_agent(agent: Agent, path: str | Path) -> None:
    """Write ``agent`` with ``torch.save``, atomically (nothing half-written on failure)."""
    import torch

    buffer = io.BytesIO()
    torch.save(agent.state(), buffer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, buffer.getvalue())


_CACHE: dict[tuple[str, float], Agent] = {}


def load_agent(path: str | Path | None = None) -> Agent:
    """The agent in ``path`` (the shipped one by default), read with ``torch.load(weights_only=True)``."""
    import pickle

    import torch

    path = Path(path) if path is not None else AGENT_PATH
    try:
        stamp = path.stat().st_mtime
    except OSError as e:
        raise AutotuneError(f"cannot read agent file '{path}': {e.strerror}; {_RETRAIN}") from None
    key = (str(path.resolve()), stamp)
    if key not in _CACHE:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise AutotuneError(
                f"'{path}' is not a weights-only agent file (torch.load(weights_only=True) refused it: {first}); "
                f"{_RETRAIN}"
            ) from None
        _CACHE[key] = Agent.from_state(state, str(path))
    return _CACHE[key]


# -- sb3 ----------------------------------------------------------------------------------------------------
def from_sb3(policy: Any, meta: dict[str, Any] | None = None) -> Agent:
    """The actor of a MaskablePPO ``MlpPolicy`` (``model.policy``) as an :class:`Agent`."""
    import torch.nn as nn

    from envs.memory_env import OBS_FIELDS

    linears = _actor_linears(policy)
    acts = {type(m).__name__ for m in policy.mlp_extractor.policy_net if not isinstance(m, nn.Linear)}
    activation = "relu" if acts == {"ReLU"} else "tanh"
    if acts - {"ReLU", "Tanh"}:
        raise ValueError(f"unsupported activation(s) {sorted(acts)}: expected Tanh or ReLU")

    def np_(p: Any) -> np.ndarray:
        return np.asarray(p.detach().cpu().float().numpy())

    hidden = [(np_(m.weight), np_(m.bias)) for m in linears]
    head = (np_(policy.action_net.weight), np_(policy.action_net.bias))
    return Agent(hidden, head, OBS_FIELDS, activation, dict(meta or {}))


def _actor_linears(policy: Any) -> list[Any]:
    """The hidden linear layers of a MaskablePPO ``MlpPolicy``'s actor, in order (its head is ``action_net``)."""
    import torch.nn as nn

    return [m for m in policy.mlp_extractor.policy_net if isinstance(m, nn.Linear)]


def into_sb3(agent: Agent, policy: Any) -> None:
    """Copy the agent's weights into the actor of a MaskablePPO ``MlpPolicy`` of the same shape."""
    import torch

    linears = _actor_linears(policy)
    if len(linears) != len(agent.hidden):
        raise ValueError(f"the policy has {len(linears)} hidden layers, the agent {len(agent.hidden)}")
    with torch.no_grad():
        for m, (w, b) in zip([*linears, policy.action_net], [*agent.hidden, agent.head], strict=True):
            m.weight.copy_(torch.from_numpy(w))
            m.bias.copy_(torch.from_numpy(b))


# -- one pass -------------------------------------------------------------------------------------------------
@dataclass
class OnePass:
    """What one pass produced: the policy, its simulated result, and how it got there."""

    actions: np.ndarray
    options: PolicyOptions  # the problem's, with the prefetch look-ahead the pass chose
    result: SimResult
    wall_s: float
    rollout_feasible: bool  # the masked rollout alone fit the budget
    fitted: int  # candidates the fit step dropped
    given_back: int  # candidates the give-back step returned to keep
    switched: int  # candidates the second-choice step moved to their other drop
    exchanged: int = 0  # decisions the exchange step gave back for others
    consolidated: int = 0  # drops the consolidation step made, each giving back others


#: The decoding steps of NOTE [ One pass ] after the rollout, in order (one_pass(stages=...) runs a prefix or
#: any subset, for the ablation in experiments/train_agent.py).
STAGES = ("fit", "lookahead", "give_back", "second_choice", "exchange", "consolidate")
SWEEPS = 4  # NOTE [ One pass ] step 4: at most this many sweeps, each after one that changed something
EXCHANGE_GIVE = 24  # NOTE [ One pass ] steps 5 and 6: the decisions tried, least preferred first
EXCHANGE_TAKE = 12  # ... and the kept candidates each may be traded for, most preferred first


def one_pass(agent: Agent, problem: Problem, stages: tuple[str, ...] = STAGES) -> OnePass:
    """NOTE [ One pass ]: the agent's policy for ``problem``."""
    from envs.memory_env import MemoryPolicyEnv

    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown one-pass stage(s) {sorted(unknown)}: expected some of {STAGES}")
    started = time.perf_counter()
    env = MemoryPolicyEnv(problem)
    obs, _ = env.reset()
    scores = np.zeros((env.k, 4), dtype=np.float64)
    masks = np.zeros((env.k, 4), dtype=bool)
    info: dict[str, Any] = {}
    for t in range(env.k):
        mask = env.action_masks()
        logits = np.where(mask, agent.logits(obs), -np.inf)
        scores[t], masks[t] = logits, mask
        obs, _, _, _, info = env.step(int(np.argmax(logits)))
    actions = np.asarray(info["actions"], dtype=np.int8)
    result = env.result  # the finished rollout, simulated by its last step
    rollout_feasible = result.feasible
    # The network's preference for dropping each candidate, and the drop it prefers.
    drop = np.where(masks[:, 1:], scores[:, 1:], -np.inf)
    best_drop = 1 + np.argmax(drop, axis=1)
    margin = drop.max(axis=1) - scores[:, KEEP]
    fitted = given_back = switched = 0
    options = problem.options
    if "fit" in stages and not result.feasible:
        actions, options, result, fitted = _fit(problem, actions, result, margin, best_drop, masks)
        if not result.feasible:  # from keep-all instead of the rollout (dropping more can raise the peak)
            alt = _fit(problem, problem.keep_all(), env.baseline, margin, best_drop, masks)
            if better(alt[2], result):
                actions, options, result, fitted = alt
        if not result.feasible:  # the frugal ends: every drop the network ranks first, the uniform policies
            alt = _frugal(problem, best_drop, margin, masks)
            if better(alt[2], result):
                actions, options, result, fitted = alt
    if "lookahead" in stages and result.feasible:
        options, result = fastest_lookahead(problem, actions, options, result)
    sweep = {"give_back", "second_choice"} & set(stages)
    for _ in range(SWEEPS if sweep and result.feasible else 0):
        changed = 0
        for i in np.argsort(margin, kind="stable"):
            if actions[i] == KEEP:
                continue
            was = actions[i]
            moves = ([KEEP] if "give_back" in stages else []) + (
                [_second_choice(scores[i], was)] if "second_choice" in stages else []
            )
            for move in moves:
                if move is None:
                    continue
                actions[i] = move
                r = problem.evaluate(actions, options)
                # Back to keep: no slower is enough (memory for nothing); another drop: it must be faster.
                if r.feasible and (
                    r.samples_per_s > result.samples_per_s or (move == KEEP and r.samples_per_s >= result.samples_per_s)
                ):
                    result = r
                    given_back += move == KEEP
                    switched += move != KEEP
                    changed += 1
                    break
                actions[i] = was
        if not changed:
            break
        if "lookahead" in stages:  # the swaps left may want another distance
            options, result = fastest_lookahead(problem, actions, options, result)
    exchanged = 0
    if "exchange" in stages and result.feasible:
        actions, result, exchanged = _exchange(problem, actions, options, result, margin, best_drop)
        if exchanged and "lookahead" in stages:
            options, result = fastest_lookahead(problem, actions, options, result)
    consolidated = 0
    if "consolidate" in stages and result.feasible:
        actions, result, consolidated = _consolidate(problem, actions, options, result, margin, best_drop)
        if consolidated and "lookahead" in stages:
            options, result = fastest_lookahead(problem, actions, options, result)
    wall_s = time.perf_counter() - started
    return OnePass(
        actions, options, result, wall_s, rollout_feasible, fitted, given_back, switched, exchanged, consolidated
    )


def _exchange(
    problem: Problem,
    actions: np.ndarray,
    options: PolicyOptions,
    result: SimResult,
    margin: np.ndarray,
    best_drop: np.ndarray,
) -> tuple[np.ndarray, SimResult, int]:
    """NOTE [ One pass ] step 5: each decision in turn (least preferred first) back to keep, and the policy
    fitted again from the kept candidates the network most prefers to drop (step 2's order, each drop kept
    only where it lowers the peak); kept where that fits and runs faster. A trade of one drop for one or
    several others, which give-back and second choice, one decision at a time, cannot make."""
    actions = actions.copy()
    exchanged = 0
    # A trade only drops kept candidates, so the decisions to try stay decisions until their own turn.
    for g in [int(i) for i in np.argsort(margin, kind="stable") if actions[i] != KEEP][:EXCHANGE_GIVE]:
        trial = actions.copy()
        trial[g] = KEEP
        back = problem.evaluate(trial, options)
        moves = ((t, int(best_drop[t])) for t in _droppable(actions, margin)[:EXCHANGE_TAKE])
        trial, r, _ = _lower_peak(problem, trial, options, back, moves)
        if r.feasible and r.samples_per_s > result.samples_per_s:
            actions, result = trial, r
            exchanged += 1
    return actions, result, exchanged


def _consolidate(
    problem: Problem,
    actions: np.ndarray,
    options: PolicyOptions,
    result: SimResult,
    margin: np.ndarray,
    best_drop: np.ndarray,
) -> tuple[np.ndarray, SimResult, int]:
    """NOTE [ One pass ] step 6: the converse of step 5. Each of the ``EXCHANGE_TAKE`` kept candidates the
    network most prefers to drop is dropped (its best drop), then the ``EXCHANGE_GIVE`` decisions it least
    preferred go back to keep in turn, each where the policy still fits; kept where the whole trade fits and
    runs faster. One large drop for several small ones, which step 5 (one for several the other way) cannot
    make."""
    actions = actions.copy()
    traded = 0
    for t in _droppable(actions, margin)[:EXCHANGE_TAKE]:
        trial = actions.copy()
        trial[t] = best_drop[t]
        r = problem.evaluate(trial, options)
        back = 0
        for g in [int(i) for i in np.argsort(margin, kind="stable") if trial[i] != KEEP and i != t][:EXCHANGE_GIVE]:
            trial[g] = KEEP
            r2 = problem.evaluate(trial, options)
            if r2.feasible:
                r, back = r2, back + 1
            else:
                trial[g] = actions[g]
        if back and r.feasible and r.samples_per_s > result.samples_per_s:
            actions, result = trial, r
            traded += 1
    return actions, result, traded


def _second_choice(logits: np.ndarray, current: int) -> int | None:
    """The legal drop (not keep) the network ranks next after ``current``, or None."""
    ranked = np.argsort(-logits, kind="stable")
    order = [int(a) for a in ranked if a not in (KEEP, current) and np.isfinite(logits[a])]
    return order[0] if order else None


def _fit(
    problem: Problem,
    actions: np.ndarray,
    result: SimResult,
    margin: np.ndarray,
    best_drop: np.ndarray,
    masks: np.ndarray,
) -> tuple[np.ndarray, PolicyOptions, SimResult, int]:
    """NOTE [ One pass ] step 2 from ``actions``: returns actions, options, result and the moves taken."""
    order = np.argsort(-margin, kind="stable")
    kept = _droppable(actions, margin)
    options = problem.options
    actions, result, fitted = _lower_peak(problem, actions, options, result, ((i, int(best_drop[i])) for i in kept))
    if not result.feasible:  # a nearer prefetch holds fewer copies on the device at once
        for lookahead in sorted(LOOKAHEADS):
            trial = dataclasses.replace(problem.options, prefetch_lookahead=lookahead)
            r = problem.evaluate(actions, trial)
            if r.feasible or r.peak_bytes < result.peak_bytes:
                options, result = trial, r
            if r.feasible:
                break
    if not result.feasible:  # a recomputed tensor is off the device until its backward use: turn swaps into it
        swapped = [int(i) for i in order if actions[i] == SWAP and masks[i, RECOMPUTE]]
        actions, result, more = _lower_peak(problem, actions, options, result, ((i, RECOMPUTE) for i in swapped))
        fitted += more
    return actions, options, result, fitted


def _droppable(actions: np.ndarray, margin: np.ndarray) -> list[int]:
    """The kept candidates the network may drop (a legal drop: a finite margin), most preferred first."""
    return [int(i) for i in np.argsort(-margin, kind="stable") if actions[i] == KEEP and np.isfinite(margin[i])]


def _frugal(
    problem: Problem, best_drop: np.ndarray, margin: np.ndarray, masks: np.ndarray
) -> tuple[np.ndarray, PolicyOptions, SimResult, int]:
    """NOTE [ One pass ] step 2's last resort: of every candidate dropped with the network's first drop, and
    of the uniform policies that hold least (recompute everything, every block's inside, swap everything:
    ``envs.simulator.frugal_starts``), each under every prefetch look-ahead, the one that fits and
    runs fastest (or holds least), for steps 3 and 4 to give back from. Illegal actions stay keep."""
    dropped = np.where(np.isfinite(margin), best_drop, KEEP).astype(np.int8)
    starts = [dropped, *frugal_starts(problem.workload).values()]
    best: tuple[np.ndarray, PolicyOptions, SimResult] | None = None
    for start in starts:
        acts = np.where(masks[np.arange(len(start)), start], start, KEEP).astype(np.int8)
        for lookahead in sorted(LOOKAHEADS):
            options = dataclasses.replace(problem.options, prefetch_lookahead=lookahead)
            r = problem.evaluate(acts, options)
            if best is None or better(r, best[2]):
                best = (acts, options, r)
    assert best is not None
    return best[0], best[1], best[2], int(np.count_nonzero(best[0] != KEEP))


def _lower_peak(
    problem: Problem, actions: np.ndarray, options: PolicyOptions, result: SimResult, moves: Iterable[tuple[int, int]]
) -> tuple[np.ndarray, SimResult, int]:
    """Apply ``(candidate, action)`` moves in order, each only if it lowers the peak, until the policy fits.
    (Dropping more is not always lower: recomputing a tensor whose inputs are dropped too replays a longer
    chain in backward, and all of it is live at once.) Returns the actions, their result, the moves kept."""
    actions = actions.copy()
    taken = 0
    for i, action in moves:
        if result.feasible:
            break
        was = actions[i]
        actions[i] = action
        r = problem.evaluate(actions, options)
        if r.peak_bytes < result.peak_bytes:
            result, taken = r, taken + 1
        else:
            actions[i] = was
    return actions, result, taken


@register
class PretrainedOnePass(Searcher):
    name = "ppo-onepass"
    composite = True
    summary = "one pass of the pretrained agent (agents/data/ppo_pretrained.pt): a policy for any model in < 1 s"

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        p = one_pass(load_agent(), problem)
        how = "rollout fit" if p.rollout_feasible else f"fit by dropping {p.fitted} more"
        note = f"one pass in {p.wall_s:.2f} s ({how}, {p.given_back} given back, {p.switched} switched)"
        return Proposal(p.actions, options=p.options, note=note)


@register
class PretrainedPPO(Portfolio):
    name = "ppo-pretrained"
    composite = True
    summary = "one pass of the pretrained agent, then Optuna TPE warm-started from it and per-tensor refinement"
    study_key = name

    def _initial_seeds(self, problem: Problem, ctx: SearchContext) -> Seeds:
        """The agent's one pass joins whatever seeds the caller passed (the baselines, in `autotune search`)."""
        r = PretrainedOnePass().search(problem, ctx)
        ctx.report("ppo-onepass", r.result)
        return (*ctx.seeds, r)

    def _phases(self, seeds: Seeds) -> list[tuple[float, Seeds, str, OptunaSearcher]]:
        return [(1.0, seeds, ".seeded", OptunaTPE())]
