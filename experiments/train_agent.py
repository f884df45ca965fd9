"""Train the pretrained agent that `--searcher ppo-onepass` and `--searcher ppo-pretrained` ship with.

    python experiments/train_agent.py [--expert-s 6] [--epochs 40] [--dagger 5] [--ppo-steps 0] [--jobs 2]
        [--out agents/data/ppo_pretrained.pt] [--cache .cache/train_agent]

1. Trace every training workload (fake mode, seconds each) and, per hardware profile and budget (20-90% of
   the no-policy peak), label it with an expert: the portfolio searcher (every heuristic, Optuna, per-tensor
   refinement) for ``--expert-s`` seconds. Labels are cached in ``--cache``, so a rerun with other
   training settings starts at step 2. Cells whose budget is below the floor (no policy fits) are skipped.
2. Behaviour cloning: teacher-forced rollouts of the expert's policy on MemoryPolicyEnv give (observation,
   action mask, label) per candidate, the label being the expert's action, or keep once the partial policy
   already fits (``expert_action``); the actor of a MaskablePPO ``MlpPolicy`` learns it by masked
   cross-entropy, every training cell weighted equally (a cell's samples share weight 1). Then ``--dagger``
   rounds: the agent's own greedy rollouts, labelled the same way, join the data and training goes on.
3. Optionally (``--ppo-steps N``) MaskablePPO fine-tunes that actor on the training cells, one random cell
   per episode, for N environment steps. Measured (after cloning with 3 DAgger rounds of 15 epochs): 60,000
   steps (216 episodes, 62 s) lowered the training cells where the one pass matches the best heuristic
   from 98 to 88 of 122 (the critic starts untrained), so the shipped agent is not fine-tuned.
4. The agent is written with ``torch.save`` as tensors, strings and numbers only (agents/pretrained.py
   reads it with ``weights_only=True``), with the split, the cells and the command in its metadata; then
   one pass per training cell, after each decoding step (the ablation of NOTE [ One pass ]).

Learning curves go to experiments/results/agent_curves.png (cross-entropy and accuracy per epoch, training
and validation cells; the one-pass speed against the expert on the validation cells every few epochs; PPO
episode rewards when fine-tuned); the per-cell one-pass results on training cells to agent_train.csv. The
held-out comparison is `python experiments/bench_quality.py --models heldout --agent` (see the README).

The split below was fixed before the first training run and is not to be tuned on held-out results: whole
model families or sizes are held out (ResNet-101, VGG-16, DenseNet-169, GPT-2 medium at 1024 tokens, and
ViT-B/16, a family the agent never sees), so the held-out table measures transfer to unseen models.
Validation cells (for the curves and early choices) are the training workloads' ``VALIDATION`` model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from headline_common import RESULTS, pyplot, save_png, write_csv


@dataclass(frozen=True)
class Spec:
    model: str
    batch: int
    seq_len: int | None = None

    @property
    def key(self) -> str:
        return f"{self.model}-b{self.batch}" + (f"-s{self.seq_len}" if self.seq_len else "")


# -- the split (fixed before training) -----------------------------------------------------------------------
TRAIN: tuple[Spec, ...] = (
    Spec("resnet18", 64),
    Spec("resnet34", 64),
    Spec("resnet50", 32),
    Spec("vgg11", 32),
    Spec("densenet121", 32),
    Spec("mobilenet_v2", 64),
    Spec("efficientnet_b0", 32),
    Spec("gpt2", 4, 512),
    Spec("bert-base", 8, 256),
)
VALIDATION = "resnet34"  # a training model whose cells are kept out of the gradient steps, for the curves
HELDOUT: tuple[Spec, ...] = (
    Spec("resnet101", 64),
    Spec("vgg16", 64),
    Spec("densenet169", 32),
    Spec("gpt2-medium", 4, 1024),
    Spec("vit_b_16", 32),
)
TRAIN_PROFILES = ("v100-16gb", "a100-40gb", "h100-80gb")
TRAIN_FRACTIONS = (0.9, 0.75, 0.6, 0.5, 0.4, 0.3, 0.2)
HELDOUT_PROFILES = ("a100-40gb", "v100-16gb")
HELDOUT_FRACTIONS = (0.8, 0.6, 0.45, 0.3)


def trace(spec: Spec, profile: str, cache: Path | None = None) -> Any:
    """The workload of ``spec`` (fake-mode trace) for ``profile``'s kernels, as `autotune search` traces it
    (runtime/target.py: profiles of one compute capability and multiprocessor count share it), cached as gzip
    JSON in ``cache``."""
    from autotune.workloads import TraceRequest, trace_model
    from runtime.hardware import get_profile
    from runtime.target import trace_key
    from runtime.workload import Workload

    hw = get_profile(profile)
    gpu, capability, multiprocessors = trace_key(hw)
    kind = f"sm{capability[0]}{capability[1]}x{multiprocessors}" if gpu and capability else ("gpu" if gpu else "cpu")
    path = cache / "traces" / f"{spec.key}.{kind}.json.gz" if cache else None
    if path is not None and path.exists():
        return Workload.load(path)
    w, _ = trace_model(TraceRequest(model=spec.model, batch_size=spec.batch, seq_len=spec.seq_len, target=hw))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        w.save(path)
    return w


def budget_at(w: Any, hw: Any, fraction: float) -> int:
    from runtime.workload import peak_report

    return int(peak_report(w, hw.alloc_granularity_bytes).peak_bytes * fraction)


# -- 1. expert labels ------------------------------------------------------------------------------------------
@dataclass
class Label:
    spec: Spec
    profile: str
    fraction: float
    actions: np.ndarray | None  # None: the budget is below the floor
    expert_speed: float  # expert samples/s over the no-policy samples/s (0 if none fits)
    heuristic_speed: float  # the best heuristic's, same units (0 if none fits)
    heuristic: str


def _label(args: tuple[Spec, str, float, float, str]) -> Label:
    spec, profile, fraction, expert_s, cache = args
    import torch

    torch.set_num_threads(1)
    from agents.base import Problem, SearchContext, baseline_names, best_of, get_searcher
    from autotune.search import budget_floor
    from runtime.hardware import get_profile

    path = Path(cache) / "labels" / f"{spec.key}.{profile}.{fraction:g}.{expert_s:g}s.json"
    if path.exists():
        d = json.loads(path.read_text())
        acts = None if d["actions"] is None else np.array(d["actions"], dtype=np.int8)
        return Label(spec, profile, fraction, acts, d["expert_speed"], d["heuristic_speed"], d["heuristic"])
    w = trace(spec, profile, Path(cache))
    hw = get_profile(profile)
    p = Problem(w, hw, budget_at(w, hw, fraction))
    ceiling = p.simulator.run(p.keep_all()).samples_per_s
    label = Label(spec, profile, fraction, None, 0.0, 0.0, "")
    if budget_floor(p) <= p.budget_bytes:
        seeds = tuple(get_searcher(n).search(p) for n in baseline_names())
        top = best_of(r for r in seeds if r.feasible)
        found = get_searcher("portfolio").search(p, SearchContext(time_limit_s=expert_s, trials=0, seed=0, seeds=seeds))
        if found.feasible:
            label.actions = found.policy.to_vector(w)
            label.expert_speed = found.result.samples_per_s / ceiling
        if top is not None:
            label.heuristic_speed, label.heuristic = top.result.samples_per_s / ceiling, top.searcher
    path.parent.mkdir(parents=True, exist_ok=True)
    d = {
        "actions": None if label.actions is None else label.actions.tolist(),
        "expert_speed": label.expert_speed,
        "heuristic_speed": label.heuristic_speed,
        "heuristic": label.heuristic,
    }
    path.write_text(json.dumps(d))
    return label


def label_all(specs: tuple[Spec, ...], expert_s: float, cache: Path, jobs: int) -> list[Label]:
    for spec in specs:  # traced once per kind of kernels, here, before the workers read the cache
        for profile in TRAIN_PROFILES:
            trace(spec, profile, cache)
    tasks = [(s, prof, f, expert_s, str(cache)) for s in specs for prof in TRAIN_PROFILES for f in TRAIN_FRACTIONS]
    labels: list[Label] = []
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for i, label in enumerate(pool.imap(_label, tasks), 1):
            labels.append(label)
            state = "below the floor" if label.actions is None else f"expert {label.expert_speed:.3f}"
            print(
                f"[{i}/{len(tasks)} {time.perf_counter() - started:5.0f} s] {label.spec.key} {label.profile} "
                f"{label.fraction:.0%}: {state}, best heuristic {label.heuristic_speed:.3f}",
                flush=True,
            )
    return labels


# -- 2. behaviour cloning ------------------------------------------------------------------------------------
@dataclass
class Dataset:
    obs: np.ndarray  # (n, OBS_SIZE) float32
    masks: np.ndarray  # (n, 4) bool
    actions: np.ndarray  # (n,) int64
    weights: np.ndarray  # (n,) float32: 1 / candidates of the cell


def expert_action(label: Label, t: int, obs: np.ndarray, mask: np.ndarray) -> int:
    """The label of candidate ``t`` in the state ``obs``: the expert's action, except keep once the partial
    policy (the rest kept) already fits: any drop from there only costs time. (The expert's own policy can
    drop more than the budget needs under the environment's default prefetch look-ahead, which it did not
    use.)"""
    from envs.memory_env import OBS_FIELDS

    if obs[OBS_FIELDS.index("need_ratio")] <= 0.0:
        return 0
    a = int(label.actions[t])
    return a if mask[a] else 0


def cell_problem(label: Label, cache: Path) -> Any:
    """The search problem of a labelled cell: its workload, profile and budget."""
    from agents.base import Problem
    from runtime.hardware import get_profile

    w = trace(label.spec, label.profile, cache)
    hw = get_profile(label.profile)
    return Problem(w, hw, budget_at(w, hw, label.fraction))


def rollouts(labels: list[Label], cache: Path, agent: Any = None) -> Dataset:
    """One rollout per labelled cell, every state labelled by :func:`expert_action`. Without ``agent`` the
    expert's actions are taken (teacher forcing); with one, the agent's greedy masked actions (DAgger: the
    states the agent reaches, not only the expert's; the expert's policy is a fixed vector, so it labels any
    state)."""
    from envs.memory_env import MemoryPolicyEnv

    obs, masks, acts, weights = [], [], [], []
    for label in labels:
        if label.actions is None:
            continue
        env = MemoryPolicyEnv(cell_problem(label, cache))
        o, _ = env.reset()
        for t in range(env.k):
            mask = env.action_masks()
            obs.append(o)
            masks.append(mask)
            acts.append(expert_action(label, t, o, mask))
            if agent is None:
                taken = int(label.actions[t]) if mask[int(label.actions[t])] else 0
            else:
                taken = int(np.argmax(np.where(mask, agent.logits(o), -np.inf)))
            o, *_ = env.step(taken)
        weights += [1.0 / env.k] * env.k
    return Dataset(
        np.array(obs, dtype=np.float32),
        np.array(masks, dtype=bool),
        np.array(acts, dtype=np.int64),
        np.array(weights, dtype=np.float32),
    )


def merge(a: Dataset, b: Dataset) -> Dataset:
    return Dataset(*(np.concatenate([x, y]) for x, y in zip(a.__dict__.values(), b.__dict__.values(), strict=True)))


def make_model(env: Any, net_arch: list[int], seed: int) -> Any:
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.logger import Logger

    model = MaskablePPO(
        "MlpPolicy",
        env,
        n_steps=2048,
        batch_size=256,
        gamma=1.0,
        learning_rate=1e-4,
        ent_coef=0.0,
        policy_kwargs={"net_arch": {"pi": net_arch, "vf": net_arch}},
        seed=seed,
        device="cpu",
        verbose=0,
    )
    model.set_logger(Logger(None, []))  # SB3's default makes an empty folder in /tmp per learn()
    return model


def behaviour_clone(
    model: Any, train: Dataset, val: Dataset, epochs: int, seed: int, on_epoch: Any = None
) -> list[dict[str, float]]:
    """Masked cross-entropy on the actor of ``model.policy``; returns per-epoch loss and accuracy."""
    import torch

    torch.manual_seed(seed)
    policy = model.policy
    params = [*policy.mlp_extractor.policy_net.parameters(), *policy.action_net.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs))

    def tensors(d: Dataset) -> tuple[torch.Tensor, ...]:
        w = d.weights / d.weights.mean()
        return (
            torch.from_numpy(d.obs),
            torch.from_numpy(d.masks),
            torch.from_numpy(d.actions),
            torch.from_numpy(w.astype(np.float32)),
        )

    def logits(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        latent = policy.mlp_extractor.forward_actor(policy.extract_features(x, policy.pi_features_extractor))
        return policy.action_net(latent).masked_fill(~m, -1e9)

    def measure(t: tuple[torch.Tensor, ...]) -> tuple[float, float]:
        with torch.no_grad():
            x, m, a, w = t
            z = logits(x, m)
            loss = (torch.nn.functional.cross_entropy(z, a, reduction="none") * w).mean()
            acc = ((z.argmax(1) == a).float() * w).sum() / w.sum()
        return float(loss), float(acc)

    tr, va = tensors(train), tensors(val)
    g = torch.Generator().manual_seed(seed)
    curve: list[dict[str, float]] = []
    n = len(tr[0])
    for epoch in range(1, epochs + 1):
        order = torch.randperm(n, generator=g)
        for start in range(0, n, 512):
            idx = order[start : start + 512]
            x, m, a, w = (t[idx] for t in tr)
            loss = (torch.nn.functional.cross_entropy(logits(x, m), a, reduction="none") * w).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        point = {"epoch": float(epoch)}
        point["train_loss"], point["train_acc"] = measure(tr)
        point["val_loss"], point["val_acc"] = measure(va)
        if on_epoch is not None:
            point.update(on_epoch(epoch))
        curve.append(point)
        print(
            f"epoch {epoch:3d}: train loss {point['train_loss']:.4f} acc {point['train_acc']:.3f} | "
            f"val loss {point['val_loss']:.4f} acc {point['val_acc']:.3f}"
            + (f" | val one-pass/expert {point['val_onepass']:.3f}" if "val_onepass" in point else ""),
            flush=True,
        )
    return curve


def onepass_scores(agent: Any, labels: list[Label], cache: Path, ablation: bool = False) -> list[dict[str, Any]]:
    """One pass per labelled cell: its speed against the expert's and the best heuristic's; with ``ablation``
    also the speed after each prefix of its decoding steps (``stage_<name>``; ``stage_rollout``: none)."""
    from agents.pretrained import STAGES, one_pass

    rows: list[dict[str, Any]] = []
    for label in labels:
        if label.actions is None:
            continue
        p = cell_problem(label, cache)
        ceiling = p.simulator.run(p.keep_all()).samples_per_s
        r = one_pass(agent, p)
        speed = r.result.samples_per_s / ceiling if r.result.feasible else 0.0
        rows.append(
            {
                "workload": label.spec.key,
                "profile": label.profile,
                "fraction": label.fraction,
                "onepass": speed,
                "expert": label.expert_speed,
                "heuristic": label.heuristic_speed,
                "best_heuristic": label.heuristic,
                "rollout_fit": r.rollout_feasible,
                "fitted": r.fitted,
                "given_back": r.given_back,
                "onepass_s": r.wall_s,
            }
        )
        if ablation:
            for n, stage in enumerate(("rollout", *STAGES)):
                part = one_pass(agent, cell_problem(label, cache), stages=STAGES[:n])
                ok = part.result.feasible
                rows[-1][f"stage_{stage}"] = part.result.samples_per_s / ceiling if ok else 0.0
    return rows


# -- 3. PPO fine-tuning -------------------------------------------------------------------------------------------
def cells_env(labels: list[Label], cache: Path, seed: int) -> Any:
    """One gymnasium environment over many cells: each reset picks a training cell at random."""
    import gymnasium as gym

    from envs.memory_env import MemoryPolicyEnv

    envs = [MemoryPolicyEnv(cell_problem(label, cache)) for label in labels if label.actions is not None]

    class Cells(gym.Env):  # type: ignore[misc]
        def __init__(self) -> None:
            self.observation_space = envs[0].observation_space
            self.action_space = envs[0].action_space
            self.rng = np.random.default_rng(seed)
            self.env = envs[0]

        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            self.env = envs[int(self.rng.integers(len(envs)))]
            return self.env.reset()

        def step(self, action: Any) -> Any:
            return self.env.step(action)

        def action_masks(self) -> np.ndarray:
            return self.env.action_masks()

    return Cells()


def fine_tune(model: Any, steps: int) -> list[float]:
    """MaskablePPO on the cells environment; returns the finished episodes' rewards."""
    from stable_baselines3.common.callbacks import BaseCallback

    rewards: list[float] = []

    class Record(BaseCallback):  # type: ignore[misc]
        def _on_step(self) -> bool:
            for done, info in zip(self.locals["dones"], self.locals["infos"], strict=True):
                if done:
                    rewards.append(float(info["reward"]))
            return True

    model.learn(total_timesteps=steps, callback=Record())
    return rewards


# -- curves ------------------------------------------------------------------------------------------------------
def plot_curves(curve: list[dict[str, float]], ppo_rewards: list[float], path: Path) -> None:
    plt = pyplot()
    panels = 3 if ppo_rewards else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.6))
    ep = [p["epoch"] for p in curve]
    axes[0].plot(ep, [p["train_loss"] for p in curve], label="training cells")
    axes[0].plot(ep, [p["val_loss"] for p in curve], label=f"validation ({VALIDATION})")
    axes[0].set(xlabel="epoch", ylabel="masked cross-entropy", title="Behaviour cloning loss")
    axes[0].legend()
    axes[1].plot(ep, [p["train_acc"] for p in curve], label="action accuracy, training")
    axes[1].plot(ep, [p["val_acc"] for p in curve], label="action accuracy, validation")
    for p in curve:  # where each DAgger round's data joined (the training loss jumps there)
        if "dagger_round" in p:
            for ax in axes[:2]:
                ax.axvline(p["epoch"] - 0.5, color="grey", linestyle=":", linewidth=0.8)
            axes[0].annotate(f"DAgger {int(p['dagger_round'])}", (p["epoch"], 1.0), xycoords=("data", "axes fraction"),
                             fontsize=7, color="grey", rotation=90, va="top")  # fmt: skip
    marks = [p for p in curve if "val_onepass" in p]
    if marks:
        axes[1].plot(
            [p["epoch"] for p in marks], [p["val_onepass"] for p in marks], "o-", label="validation one pass / expert"
        )
    axes[1].set(xlabel="epoch", ylim=(0, 1.05), title="Accuracy and one-pass quality")
    axes[1].legend(fontsize=8)
    if ppo_rewards:
        r = np.array(ppo_rewards)
        window = max(1, len(r) // 50)
        smooth = np.convolve(r, np.ones(window) / window, mode="valid")
        axes[2].plot(smooth)
        axes[2].set(xlabel="episode", ylabel=f"reward (mean of {window})", title="MaskablePPO fine-tuning")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--expert-s", type=float, default=6.0, help="seconds of portfolio search per training cell")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--net-arch", default="64,64", help="hidden layer widths of the actor")
    ap.add_argument("--dagger", type=int, default=5, help="DAgger rounds after cloning (0: cloning only)")
    ap.add_argument("--dagger-epochs", type=int, default=10, help="epochs after each DAgger round")
    ap.add_argument("--ppo-steps", type=int, default=0, help="MaskablePPO fine-tuning steps after cloning")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--models", default=",".join(s.key for s in TRAIN), help="subset of the training workloads")
    ap.add_argument("--out", type=Path, default=Path("agents/data/ppo_pretrained.pt"))
    ap.add_argument("--cache", type=Path, default=Path(".cache/train_agent"))
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument(
        "--score-only",
        action="store_true",
        help="no training: score the agent in --out on the training cells (after a change to the one pass's "
        "decoding), rewriting agent_train.csv",
    )
    args = ap.parse_args()

    import torch

    from agents.pretrained import from_sb3, save_agent

    keys = {k.strip() for k in args.models.split(",") if k.strip()}
    unknown = keys - {s.key for s in TRAIN}
    if unknown:
        raise SystemExit(f"unknown training workload(s) {', '.join(sorted(unknown))}: expected some of "
                         f"{', '.join(s.key for s in TRAIN)}")  # fmt: skip
    specs = tuple(s for s in TRAIN if s.key in keys)
    net_arch = [int(x) for x in args.net_arch.split(",") if x]
    torch.set_num_threads(1)
    started = time.perf_counter()
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        print(
            f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}: the GPU traces hold cuBLAS workspaces "
            "of that size, not the default `autotune search` plans with (unset it to train the shipped agent)",
            flush=True,
        )
    labels = label_all(specs, args.expert_s, args.cache, args.jobs)
    print(f"labelled {len(labels)} cells in {time.perf_counter() - started:.0f} s", flush=True)
    if args.score_only:
        from agents.pretrained import load_agent

        report(onepass_scores(load_agent(args.out), labels, args.cache, ablation=True), args.results)
        return
    val_labels = [lb for lb in labels if lb.spec.model == VALIDATION]
    train_labels = [lb for lb in labels if lb.spec.model != VALIDATION] or val_labels
    train, val = rollouts(train_labels, args.cache), rollouts(val_labels or train_labels, args.cache)
    if not val_labels or train_labels is val_labels:
        what = "no" if not val_labels else "only"
        print(f"warning: --models holds {what} {VALIDATION} cells: the validation curves are the training cells' "
              "own (give both it and another model to keep them apart)", flush=True)  # fmt: skip
    print(f"dataset: {len(train.actions)} training decisions, {len(val.actions)} validation", flush=True)

    env = cells_env(train_labels, args.cache, args.seed)
    model = make_model(env, net_arch, args.seed)
    meta_base: dict[str, Any] = {
        "train": [s.key for s in specs if s.model != VALIDATION],
        "validation": [s.key for s in specs if s.model == VALIDATION],
        "heldout": [s.key for s in HELDOUT],
        "profiles": list(TRAIN_PROFILES),
        "fractions": list(TRAIN_FRACTIONS),
        "expert_s": args.expert_s,
        "epochs": args.epochs,
        "ppo_steps": args.ppo_steps,
        "command": " ".join(["python", "experiments/train_agent.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        # GPU traces hold cuBLAS's workspaces as this variable sizes them (runtime/target.py G6): unset is the
        # default `autotune search` plans with
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset"),
    }

    def on_epoch(epoch: int) -> dict[str, float]:
        if epoch % 10 and epoch != args.epochs:
            return {}
        rows = onepass_scores(from_sb3(model.policy), val_labels or train_labels, args.cache)
        ratios = [r["onepass"] / r["expert"] for r in rows if r["expert"] > 0]
        return {"val_onepass": float(np.mean(ratios))} if ratios else {}

    curve = behaviour_clone(model, train, val, args.epochs, args.seed, on_epoch)
    for round_ in range(1, args.dagger + 1):
        started = time.perf_counter()
        train = merge(train, rollouts(train_labels, args.cache, agent=from_sb3(model.policy)))
        print(f"DAgger round {round_}: {len(train.actions)} decisions ({time.perf_counter() - started:.0f} s)")
        offset = curve[-1]["epoch"]
        more = behaviour_clone(model, train, val, args.dagger_epochs, args.seed + round_, on_epoch)
        more[0]["dagger_round"] = float(round_)
        curve += [{**p, "epoch": p["epoch"] + offset} for p in more]
    rewards: list[float] = []
    if args.ppo_steps > 0:
        started = time.perf_counter()
        rewards = fine_tune(model, args.ppo_steps)
        print(f"PPO fine-tuning: {len(rewards)} episodes in {time.perf_counter() - started:.0f} s", flush=True)
    agent = from_sb3(model.policy, meta_base)
    rows = onepass_scores(agent, labels, args.cache, ablation=True)
    save_agent(agent, args.out)
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()[:12]
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB, sha256 {digest})")
    plot_curves(curve, rewards, args.results / "agent_curves.png")
    report(rows, args.results)


def report(rows: list[dict[str, Any]], results: Path) -> None:
    """The training cells' one-pass scores to agent_train.csv, and each decoding step's share printed."""
    header = list(rows[0]) if rows else []
    write_csv(results / "agent_train.csv", header, rows)
    for key in [k for k in header if k.startswith("stage_")]:
        ge = sum(r[key] >= r["heuristic"] - 1e-9 for r in rows)
        ratio = np.median([r[key] / r["heuristic"] for r in rows if r["heuristic"] > 0])
        stage = key.removeprefix("stage_")
        print(f"  {stage:>13}: >= best heuristic in {ge:3d} of {len(rows)}, median ratio {ratio:.4f}")
    at_least = sum(r["onepass"] >= r["heuristic"] - 1e-9 for r in rows)
    vs_expert = np.mean([r["onepass"] / r["expert"] for r in rows if r["expert"] > 0])
    print(f"training cells: one pass >= best heuristic in {at_least} of {len(rows)}; one pass / expert {vs_expert:.3f}")


if __name__ == "__main__":
    main()
