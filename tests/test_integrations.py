"""A policy inside the training loops people use (runtime/integrations): the Hugging Face Trainer, Lightning
and accelerate. Each loop trains a tiny model with gradient accumulation 2, with and without the policy;
the gradients before each optimizer step and the parameters after it are bit-identical, the runtime did
what the policy says in every micro-batch (bytes swapped, tensors recomputed, no unknown key), a lossy
policy does change them (so the comparison can fail), and a loop that accumulates another number of
micro-batches than the policy was planned for is refused before it trains."""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from envs.simulator import uniform_actions
from experiments.user_models import hf_causal_lm
from runtime.apply import RuntimeStats
from runtime.errors import AutotuneError
from runtime.measure import StorageTracker
from runtime.policy import Action, Policy, PolicyOptions, load_policy
from runtime.trace import capture
from runtime.vocab import COMPRESS, KEEP, SWAP
from runtime.workload import Workload
from tests.test_cli import run

B, T, GA = 4, 32, 2  # micro-batch of 4 sequences of 32 tokens, 2 micro-batches per optimizer step
STEPS = 2  # optimizer steps: the second runs on parameters the policy's gradients made


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps one state per process (its mixed precision included) that a later Accelerator may not
    change, and the Trainer makes one too: each test starts from none, as a new process would."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# -- policies --------------------------------------------------------------------------------------------------
def _recompute(w: Workload) -> Policy:
    """Every block recomputed, its input kept (what torch.utils.checkpoint on every block does)."""
    return Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu")


def _swap_and_recompute(w: Workload) -> Policy:
    """Every block recomputed and its kept input swapped: both mechanisms in one policy."""
    vec = uniform_actions(w, Action.RECOMPUTE)
    vec[vec == KEEP] = SWAP
    return Policy.from_vector(w, vec, hardware="cpu")


def _lossy(w: Workload) -> Policy:
    vec = np.full(len(w.candidates), COMPRESS, dtype=np.int8)
    return Policy.from_vector(w, vec, hardware="cpu", options=PolicyOptions(lossy=True))


def _did_it(policy: Policy, stats: list[RuntimeStats]) -> None:
    """Every micro-batch ran under the policy: bytes swapped if it swaps, tensors recomputed if it
    recomputes, every key known."""
    assert len(stats) == GA * STEPS, stats
    counts = policy.counts()
    for s in stats:
        assert s.unknown_keys == [], s.unknown_keys
        assert (s.swapped_bytes > 0) == (counts[Action.SWAP] > 0), s
        assert (s.regions + s.recomputed_ops > 0) == (counts[Action.RECOMPUTE] > 0), s


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- a 2-layer GPT-2, the Trainer's way -------------------------------------------------------------------------
def _gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)  # the same weights in every run (dropout on: the runtime replays its masks)
    return hf_causal_lm(batch_size=B, seq_len=T)


def _trainer_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    # The Trainer hands models that take it the number of target tokens (num_items_in_batch): the loss is a
    # sum divided by it, and autograd saves that divisor, so the trace must see it too.
    return model(**batch, num_items_in_batch=batch["labels"][:, 1:].ne(-100).sum()).loss  # type: ignore[no-any-return]


def _gpt2_workload(
    loss_fn: Callable[..., torch.Tensor] = _trainer_loss, precision: str = "fp32", optimizer: str = "adamw"
) -> Workload:
    """The 2-layer GPT-2's workload, traced with the optimizer the Trainer trains with by default."""
    return capture(
        lambda: (*_gpt2(), loss_fn), name="hf_causal_lm", batch_size=B, grad_accum=GA, precision=precision,
        optimizer=optimizer,
    )  # fmt: skip


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sequences of T random tokens, labels equal to the inputs (the model shifts them)."""

    def __init__(self, n: int = B * GA) -> None:
        self.x = torch.randint(0, 128, (n, T), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


_trainer_callbacks: list[Any] = []  # the latest _train_hf's, for a test whose training raised


def _train_hf(
    tmp_path: Path,
    policy: Policy | None,
    ga: int = GA,
    trainer_cls: Any = None,
    bf16: bool = False,
    close: bool = True,
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list[RuntimeStats], Any]:
    """STEPS optimizer steps of the Trainer: the gradients before each, the parameters after the last, the
    runtime's stats of every micro-batch, and the trainer."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from runtime.integrations.hf import PolicyCallback

    grads: list[list[torch.Tensor]] = []
    done: list[RuntimeStats] = []
    cb = PolicyCallback(policy) if policy is not None else None

    class Watch(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: nn.Module, **kw: Any) -> None:
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            if cb is not None:
                done.extend(cb.stats)  # after the policy's own on_pre_optimizer_step: this step's micro-batches

    model, _ = _gpt2()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=B, gradient_accumulation_steps=ga,
        max_steps=STEPS, learning_rate=1e-2, report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0, bf16=bf16,
    )  # fmt: skip
    callbacks = [c for c in (cb, Watch()) if c is not None]
    _trainer_callbacks[:] = callbacks
    trainer = (trainer_cls or Trainer)(model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks)
    torch.manual_seed(0)  # the sampler's order: the same with and without the policy
    if cb is None or not close:
        trainer.train()
    else:
        with cb:  # a refusal inside a step must not leave its hooks on for the tests that follow
            trainer.train()
    return grads, [p.detach().clone() for p in model.parameters()], done, trainer


def test_trainer_callback_keeps_gradients_bit_identical(tmp_path: Path) -> None:
    w = _gpt2_workload()
    ref_grads, ref_params, _, _ = _train_hf(tmp_path, None)
    assert len(ref_grads) == STEPS
    policy = _swap_and_recompute(w)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="autotune")  # an unknown key would warn
        grads, params, done, trainer = _train_hf(tmp_path, policy)
    assert all(_same(a, b) for a, b in zip(grads, ref_grads, strict=True))
    assert _same(params, ref_params)
    _did_it(policy, done)
    from runtime.integrations.hf import PolicyCallback

    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, PolicyCallback))
    assert not cb.steps.is_open and cb.steps.micro_batches == GA * STEPS


@pytest.mark.slow
def test_trainer_in_bf16(tmp_path: Path) -> None:
    """bf16=True: the Trainer enters autocast inside the forward accelerate puts on the model, after the
    model's own pre-hooks; the runtime checks the precision at its submodules' calls, where autocast is on."""
    ref_grads, ref_params, _, _ = _train_hf(tmp_path, None, bf16=True)
    policy = _swap_and_recompute(_gpt2_workload(precision="bf16"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="autotune")
        grads, params, done, _ = _train_hf(tmp_path, policy, bf16=True)
    assert all(_same(a, b) for a, b in zip(grads, ref_grads, strict=True)) and _same(params, ref_params)
    _did_it(policy, done)
    with pytest.raises(AutotuneError, match="made for fp32 training but this forward runs in bf16"):
        _train_hf(tmp_path, _swap_and_recompute(_gpt2_workload()), bf16=True)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # closed by `with cb`


def test_trainer_lossy_policy_changes_the_gradients(tmp_path: Path) -> None:
    """The comparison above can fail: a policy that compresses to bfloat16 changes the gradients."""
    ref_grads, _, _, _ = _train_hf(tmp_path, None)
    grads, _, _, _ = _train_hf(tmp_path, _lossy(_gpt2_workload()))
    assert not _same(grads[0], ref_grads[0])


def test_trainer_refuses_another_grad_accum(tmp_path: Path) -> None:
    policy = _swap_and_recompute(_gpt2_workload())  # planned for 2 micro-batches per step
    with pytest.raises(AutotuneError) as e:
        _train_hf(tmp_path, policy, ga=1)
    msg = str(e.value)
    assert "\n" not in msg
    assert "gradient_accumulation_steps=1" in msg and "planned for 2 micro-batches" in msg
    assert "--grad-accum 1" in msg


def test_trainer_refuses_a_policy_planned_with_another_optimizers_state(tmp_path: Path) -> None:
    """The Trainer trains with AdamW by default: a policy searched with SGD (the default of `autotune search`)
    was taken without a word, and planned 16% under its peak (a QA run). Refused before training, naming the
    option that searches for it."""
    with pytest.raises(AutotuneError, match=r"optimizer is AdamW, but .* planned with sgd.*--optimizer adamw"):
        _train_hf(tmp_path, _swap_and_recompute(_gpt2_workload(optimizer="sgd")))


def test_a_policy_for_another_model_is_said_so_before_its_accumulation(tmp_path: Path) -> None:
    """Given a policy for another model and another accumulation, the callbacks asked to change the
    accumulation first, which only led to the real refusal (a QA run): the model is checked first."""
    policy = _swap_and_recompute(_net_workload())  # another model, planned for 2 micro-batches per step
    with pytest.raises(AutotuneError, match="other parameters"):
        _train_hf(tmp_path, policy, ga=1)
    with pytest.raises(AutotuneError, match="other parameters"):
        _train_accelerate(policy, ga=1)


def test_trainer_callback_closes_what_an_exception_left_open(tmp_path: Path) -> None:
    """A callback sees no exception: a forward that raises leaves the micro-batch's saved-tensor hooks
    installed; ``close()`` takes them and every dispatch mode the runtime entered away."""
    from transformers import Trainer

    class Failing(Trainer):  # type: ignore[misc]
        def training_step(self, model: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
            model.transformer.h[1].register_forward_pre_hook(lambda *_: 1 / 0)
            return super().training_step(model, *args, **kwargs)  # type: ignore[no-any-return]

    from runtime.integrations.hf import PolicyCallback

    top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
    with pytest.raises(ZeroDivisionError):
        _train_hf(tmp_path, _swap_and_recompute(_gpt2_workload()), trainer_cls=Failing, close=False)
    cb = next(c for c in _trainer_callbacks if isinstance(c, PolicyCallback))
    assert cb.steps.is_open and top_hooks(False) is not None  # the hazard the docstring names
    with cb:  # as a context manager, it closes on the way out
        pass
    assert not cb.steps.is_open and top_hooks(False) is None and _get_current_dispatch_mode_stack() == []


def test_trainer_peak_is_lower_under_a_recompute_policy(tmp_path: Path) -> None:
    """The storages each training_step creates, counted by runtime.measure's CPU tracker: recomputing every
    block holds less than keeping everything."""
    from transformers import Trainer

    peaks: list[int] = []

    class Measured(Trainer):  # type: ignore[misc]
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            with StorageTracker() as tracker:
                loss = super().training_step(*args, **kwargs)
            peaks.append(tracker.peak_bytes)
            return loss  # type: ignore[no-any-return]

    w = _gpt2_workload()
    _train_hf(tmp_path, None, trainer_cls=Measured)
    plain = max(peaks)
    peaks.clear()
    policy = _recompute(w)
    _, _, done, _ = _train_hf(tmp_path, policy, trainer_cls=Measured)
    _did_it(policy, done)
    print(f"training_step peak: {plain} bytes plain, {max(peaks)} under recompute ({max(peaks) / plain - 1:+.1%})")
    assert max(peaks) < 0.9 * plain


# -- Lightning --------------------------------------------------------------------------------------------------
class _Net(nn.Module):
    """A small CNN with BatchNorm (its running statistics must be updated once per micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()) for c in (3, 16, 16))
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=(2, 3)))  # (B, 10)


def _images(n: int = B * GA) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _cross_entropy(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(net(x), y)


def _net_workload() -> Workload:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
        torch.manual_seed(0)
        x, y = _images(B)
        return _Net(), (x, y), _cross_entropy

    return capture(build, name="net", batch_size=B, grad_accum=GA)


def _train_lightning(
    policy: Policy | None, accumulate: int = GA, fail: bool = False
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list[RuntimeStats]]:
    import lightning.pytorch as pl

    from runtime.integrations.lightning import PolicyCallback

    grads: list[list[torch.Tensor]] = []
    done: list[RuntimeStats] = []
    cb = PolicyCallback(policy, module="net") if policy is not None else None  # the policy is for the inner net

    class Lit(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = _Net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return _cross_entropy(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # after every callback's
            grads.append([p.grad.clone() for p in self.parameters()])
            if cb is not None:
                done.extend(cb.stats)

    lit = Lit()
    if fail:  # the second block's forward raises
        lit.net.blocks[1].register_forward_pre_hook(lambda *_: 1 / 0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_images()), batch_size=B)
    trainer = pl.Trainer(
        max_steps=STEPS, accumulate_grad_batches=accumulate, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[cb] if cb is not None else [],
    )  # fmt: skip
    trainer.fit(lit, train_dataloaders=loader)
    return grads, [t.detach().clone() for t in [*lit.parameters(), *lit.buffers()]], done


def test_lightning_callback_keeps_gradients_bit_identical() -> None:
    w = _net_workload()
    ref_grads, ref_state, _ = _train_lightning(None)
    assert len(ref_grads) == STEPS
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="autotune")  # an unknown key would warn
        grads, state, done = _train_lightning(policy := _swap_and_recompute(w))
    assert all(_same(a, b) for a, b in zip(grads, ref_grads, strict=True))
    assert _same(state, ref_state)  # parameters and BatchNorm statistics
    _did_it(policy, done)
    grads, _, _ = _train_lightning(_lossy(w))
    assert not _same(grads[0], ref_grads[0])


def test_lightning_callback_closes_on_an_exception() -> None:
    with pytest.raises(ZeroDivisionError):
        _train_lightning(_swap_and_recompute(_net_workload()), fail=True)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert _get_current_dispatch_mode_stack() == []


def test_lightning_refuses_another_accumulation() -> None:
    with pytest.raises(AutotuneError, match=r"accumulate_grad_batches\)=1, but .* planned for 2 micro-batches"):
        _train_lightning(_swap_and_recompute(_net_workload()), accumulate=1)


# -- accelerate -------------------------------------------------------------------------------------------------
def _train_accelerate(
    policy: Policy | str | None, ga: int = GA, mixed_precision: str = "no"
) -> tuple[list[torch.Tensor], list[RuntimeStats]]:
    from accelerate import Accelerator

    from runtime.integrations.accelerate import applied

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ga, mixed_precision=mixed_precision)
    model, _ = _gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_Tokens(B * GA * STEPS), batch_size=B)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    done: list[RuntimeStats] = []
    for batch in loader:
        with accelerator.accumulate(model):
            if policy is None:
                accelerator.backward(model(**batch).loss)
            else:
                with applied(accelerator, model, policy) as stats:
                    accelerator.backward(model(**batch).loss)
                done.append(stats)
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()], done


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_accelerate_keeps_parameters_bit_identical(precision: str) -> None:
    mixed = {"fp32": "no", "bf16": "bf16"}[precision]  # bf16: autocast inside the forward prepare() wraps
    w = _gpt2_workload(lambda m, b: m(**b).loss, precision, "sgd")  # accelerate's loop: the model's own mean loss
    ref, _ = _train_accelerate(None, mixed_precision=mixed)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="autotune")
        got, done = _train_accelerate(policy := _swap_and_recompute(w), mixed_precision=mixed)
    assert _same(got, ref)
    _did_it(policy, done)
    if precision == "bf16":
        return
    with pytest.raises(AutotuneError, match=r"gradient_accumulation_steps\)=1, but .* planned for 2"):
        _train_accelerate(policy, ga=1)
    got, _ = _train_accelerate(_lossy(w))
    assert not _same(got, ref)


def test_accelerate_takes_a_policy_files_path(tmp_path: Path) -> None:
    """The callbacks and PolicySteps take a policy file's path; accelerate's ``applied`` raised AttributeError
    on one ('str' object has no attribute 'applied': a QA run). Given at every micro-batch, the path is loaded
    once: the micro-batches after the first run from what it learnt, as with the Policy itself (each had
    loaded the file again and learnt again: hooks on every pack, regions checkpointed)."""
    w = _gpt2_workload(lambda m, b: m(**b).loss, optimizer="sgd")
    policy = _swap_and_recompute(w)
    path = tmp_path / "gpt2.policy.json"
    policy.save(path)
    ref, _ = _train_accelerate(None)
    got, done = _train_accelerate(str(path))
    assert _same(got, ref)
    _did_it(policy, done)
    _, by_object = _train_accelerate(policy)
    learnt = [(s.hooked_calls, s.checkpointed) for s in by_object]  # a first step: no hooked calls, checkpoints
    assert [(s.hooked_calls, s.checkpointed) for s in done] == learnt and learnt[0] != learnt[-1]


# -- install hints ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("integration", "framework", "extra"),
    [("hf", "transformers", "hf"), ("lightning", "lightning", "lightning"), ("accelerate", "accelerate", "hf")],
)
def test_a_missing_framework_gives_the_install_hint(
    monkeypatch: pytest.MonkeyPatch, integration: str, framework: str, extra: str
) -> None:
    from runtime.integrations import MissingDependency

    monkeypatch.setitem(sys.modules, framework, None)  # what `import framework` sees when it is not installed
    monkeypatch.delitem(sys.modules, f"runtime.integrations.{integration}", raising=False)
    with pytest.raises(MissingDependency, match=rf"pip install autotune\[{extra}\]") as e:
        importlib.import_module(f"runtime.integrations.{integration}")
    assert isinstance(e.value, ImportError) and "\n" not in str(e.value)


def test_a_submodule_that_does_not_exist_is_named() -> None:
    from runtime.integrations import PolicySteps

    steps = PolicySteps(_swap_and_recompute(_net_workload()), module="nett")
    with pytest.raises(AutotuneError, match=r"module='nett' names no submodule of Sequential: .*top level: 0\)"):
        steps.bind(nn.Sequential(_Net()))


# -- the CLI on a Trainer-style factory ------------------------------------------------------------------------
@pytest.mark.slow
def test_search_takes_a_trainer_style_factory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`autotune search` on experiments.user_models:hf_causal_lm (a dict batch, the loss the model's own):
    a policy under a budget below the no-policy peak, for 2 micro-batches per step; its file, given to the
    Trainer's callback as it is, trains bit-identically."""
    model = "experiments.user_models:hf_causal_lm"
    out, store = tmp_path / "p.json", f"sqlite:///{tmp_path / 's.db'}"
    # 3.5 MB: well below the no-policy peak (4.30 MB) and above what a 5-second search reaches on a loaded machine
    # (2.85 MiB answers 3 MB unloaded, but in a CI run beside other work it reached 2.94 MiB only).
    args = ["--budget", "3.5MB", "--gpu", "cpu", "--grad-accum", "2", "--optimizer", "adamw", "--trials", "3",
            "--timeout", "5"]  # fmt: skip
    code, stdout, err = run(capsys, "search", "--model", model, *args, "--out", str(out), "--storage", store, "--json")
    assert code == 0, err
    found = json.loads(stdout)
    assert found["feasible"] and found["written"], found
    assert found["peak_bytes"] <= 3_500_000 < found["no_policy_peak_bytes"]
    policy = load_policy(out)
    assert policy.grad_accum == 2 and policy.counts()[Action.KEEP] < len(policy.actions)
    assert any(a in (Action.SWAP, Action.RECOMPUTE) for a in policy.actions.values())
    ref_grads, ref_params, _, _ = _train_hf(tmp_path, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads, params, done, _ = _train_hf(tmp_path, policy)
    assert all(_same(a, b) for a, b in zip(grads, ref_grads, strict=True)) and _same(params, ref_params)
    assert all(s.regions + s.recomputed_ops + s.swapped_bytes > 0 for s in done)
    # The one tensor the factory's loss does not save: the divisor num_items_in_batch that the Trainer
    # passes to the model (see _trainer_loss), kept and reported in the first micro-batch where the runtime
    # sees packs at all: a policy that only recomputes through regions hooks none (R11), and which one a
    # 5-second search answers varies.
    unknown = [k for s in done for k in s.unknown_keys]
    assert len(unknown) <= 1 and all(k.startswith("<root>#") and k.endswith(":nograd") for k in unknown), unknown
    noted = [str(w.message) for w in caught if "is not in the policy" in str(w.message)]
    assert len(noted) == len(unknown) and all(repr(k) in m for k, m in zip(unknown, noted, strict=True)), noted
