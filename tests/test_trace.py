"""Workload capture: known answers on a tiny MLP, fake vs real agreement, stability, fingerprints, files."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from torch import nn

from runtime.errors import AutotuneError
from runtime.trace import capture
from runtime.workload import Phase, TensorKind, Workload, memory_timeline, peak_report


def mlp_build(hidden: int = 8, layers: int = 1):  # type: ignore[no-untyped-def]
    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        mods: list[nn.Module] = [nn.Linear(4, hidden), nn.ReLU()]
        for _ in range(layers - 1):
            mods += [nn.Linear(hidden, hidden), nn.ReLU()]
        mods.append(nn.Linear(hidden, 2))
        x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
        return nn.Sequential(*mods), (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])

    return build


def tiny_cnn_build(batch: int = 2):  # type: ignore[no-untyped-def]
    """Conv-BN-ReLU twice with a skip connection and a reused ReLU module (called three times)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(8)
            self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
            self.bn2 = nn.BatchNorm2d(8)
            self.relu = nn.ReLU(inplace=True)
            self.fc = nn.Linear(8, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(h))
            out += h
            out = self.relu(out)
            out = self.relu(out.mean((2, 3)))
            return self.fc(out)

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        x, y = torch.randn(batch, 3, 8, 8), torch.randint(0, 5, (batch,))
        return Net(), (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])

    return build


def test_mlp_known_answers() -> None:
    """Sequential(Linear(4,8), ReLU, Linear(8,2)) at batch 3 with SGD+momentum, by hand."""
    w = capture(mlp_build(), name="mlp", batch_size=3, fake=True)
    # Persistent: parameters 8*4+8+2*8+2 = 58 floats = 232 B, momentum buffers 232 B, batch x 3*4 floats
    # (48 B) and y 3 int64 (24 B): 536 B.
    assert peak_report(w).persistent_bytes == 536
    # Saved for backward and allocated in forward: the ReLU output (3*8 floats; the second Linear saves the
    # same storage), log_softmax's output (3*2 floats) and nll_loss's total_weight (one float). The first
    # Linear saves x (the batch) and every Linear its weight: excluded.
    assert [(c.key, c.nbytes) for c in w.candidates] == [
        ("1#0.0:Relu", 96),
        ("<loss>#0.0:LogSoftmax", 24),
        ("<loss>#0.2:nograd", 4),
    ]
    relu = w.candidates[0]
    assert w.ops[relu.producer].name == "aten.relu.default"
    assert w.ops[relu.last_fwd_use].name == "aten.addmm.default" and w.ops[relu.last_fwd_use].module == "2"
    # Backward uses: the second Linear's weight gradient (mm with the saved input) and ReLU's backward.
    assert [w.ops[i].name for i in relu.bwd_uses] == ["aten.mm.default", "aten.threshold_backward.default"]
    # Dropped, the ReLU output dies right after its last forward use; kept, after threshold_backward.
    assert relu.free_if_dropped_op == relu.last_fwd_use
    assert w.tensors[relu.tensor].free_op == relu.bwd_uses[-1]
    # Recomputing it needs the first addmm's output.
    assert [w.ops[w.tensors[t].alloc_op].name for t in relu.recompute_inputs] == ["aten.addmm.default"]
    # Peak during threshold_backward: 536 persistent + ReLU output 96 + loss 4 + its ones_like seed 4 +
    # grad of the ReLU output 96 + grad wrt its input 96 + the second Linear's weight and bias grads 64 + 8.
    report = peak_report(w)
    assert w.ops[report.peak_op].name == "aten.threshold_backward.default"
    assert report.peak_bytes == 536 + 96 + 4 + 4 + 96 + 96 + 64 + 8 == 904
    assert report.by_kind_bytes["gradient"] == 72
    # Gradients (58 floats) are all alive after backward and die at the end of the iteration.
    assert sum(t.nbytes for t in w.tensors if t.kind == TensorKind.GRADIENT) == 232
    assert memory_timeline(w)[-1] == 536 + 232


def test_phases_and_backward_modules() -> None:
    w = capture(tiny_cnn_build(), name="cnn", batch_size=2, fake=True)
    phases = [op.phase for op in w.ops]
    assert phases == sorted(phases, key=[Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER].index)
    conv_bwd = [op.module for op in w.ops if op.name == "aten.convolution_backward.default"]
    assert conv_bwd == ["conv2", "conv1"]
    assert {op.module for op in w.ops if op.name == "aten.native_batch_norm_backward.default"} == {
        "bn1",
        "bn2",
    }
    # The ReLU module is called three times; each call names its saved output separately.
    relu_keys = sorted(c.key for c in w.candidates if c.key.startswith("relu#"))
    assert [k.split(".")[0] for k in relu_keys] == ["relu#0", "relu#1", "relu#2"]
    # BatchNorm running statistics are buffers, never candidates.
    buffers = {t.id for t in w.tensors if t.kind == TensorKind.BUFFER}
    assert not buffers & {c.tensor for c in w.candidates}


def test_fake_and_real_agree() -> None:
    fake = capture(tiny_cnn_build(), name="cnn", batch_size=2, fake=True)
    real = capture(tiny_cnn_build(), name="cnn", batch_size=2, fake=False)
    assert [c.key for c in fake.candidates] == [c.key for c in real.candidates]
    assert [op.name for op in fake.ops] == [op.name for op in real.ops]
    assert peak_report(fake).peak_bytes == peak_report(real).peak_bytes
    assert fake.fingerprint == real.fingerprint and fake.shape_fingerprint == real.shape_fingerprint
    assert all(op.time_s is None for op in fake.ops)
    assert all(op.time_s is not None and op.time_s >= 0 for op in real.ops)


def test_a_model_that_deep_copies_its_layers_traces_in_fake_mode() -> None:
    """``nn.TransformerEncoder`` deep-copies its layer; under FakeTensorMode the copies came out in a fake mode
    of their own, and the fake trace (the default for a GPU profile) failed with an internal error ("Mixing
    fake modes NYI", a QA run). Now it traces, with the real trace's keys and sizes; a parameter shared by
    two modules stays one."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(32, 10)
            self.tied = nn.Linear(32, 10)
            self.tied.weight = self.head.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.enc(x).mean(1)
            return self.head(h) + self.tied(h)

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        x, y = torch.randn(4, 6, 32), torch.randint(0, 10, (4,))
        return Net(), (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])

    fake = capture(build, name="encoder", batch_size=4, fake=True)
    real = capture(build, name="encoder", batch_size=4, fake=False)
    assert [(c.key, c.nbytes) for c in fake.candidates] == [(c.key, c.nbytes) for c in real.candidates]
    assert len(fake.candidates) > 20
    assert fake.fingerprint == real.fingerprint


def test_a_padding_mask_written_by_indexing_before_the_model_is_built_traces_in_fake_mode() -> None:
    """A factory that writes its padding mask by indexing (``pad[1, 4:] = True``), then builds an
    ``nn.TransformerEncoder``: torch's deep copy of the layer's fake parameters then read their storage's bytes,
    which a fake tensor does not have, and the process died (a segmentation fault in `autotune profile` and
    `autotune train` of such a model, a QA run). A fake tensor is now copied as a new one of its shape."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

        def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            return self.enc(x, src_key_padding_mask=pad)

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        x, pad = torch.randn(4, 8, 32), torch.zeros(4, 8, dtype=torch.bool)
        pad[1, 6:] = True
        return Net(), (x, pad), lambda m, b: m(*b).square().mean()

    from runtime.hardware import get_profile

    fake = capture(build, name="padded", batch_size=4, fake=True, target=get_profile("a100-40gb"))
    real = capture(build, name="padded", batch_size=4, fake=False)
    assert fake.fingerprint == real.fingerprint and len(fake.candidates) > 20


def test_a_factory_that_converts_its_model_to_channels_last_traces_in_fake_mode() -> None:
    """``model.to(memory_format=torch.channels_last)`` in a factory failed under FakeTensorMode ("_apply():
    Couldn't swap Conv2d.weight", blamed on the factory: a QA run). Now the fake trace runs, with the real
    trace's keys and sizes."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                              nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).to(memory_format=torch.channels_last)  # fmt: skip
        x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (4,))
        return model, (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])

    fake = capture(build, name="cl", batch_size=4, fake=True)
    real = capture(build, name="cl", batch_size=4, fake=False)
    assert [(c.key, c.nbytes) for c in fake.candidates] == [(c.key, c.nbytes) for c in real.candidates]
    assert len(fake.candidates) >= 4


def test_a_model_that_converts_a_submodule_in_its_forward_traces_in_fake_mode() -> None:
    """Switch Transformers' router calls ``self.classifier.to(self.dtype)`` in its forward, a no-op in eager;
    the fake trace failed there ("_apply(): Couldn't swap Linear.weight", an internal error: a QA run). It now
    runs, with the real trace's keys and sizes."""

    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.classifier = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.classifier = self.classifier.to(torch.float32)
            return self.classifier(x).relu()

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), Router(), nn.Linear(4, 10))
        return model, (torch.randn(4, 8), torch.randint(0, 10, (4,))), lambda m, b: nn.functional.cross_entropy(
            m(b[0]), b[1])  # fmt: skip

    fake = capture(build, name="router", batch_size=4, fake=True)
    real = capture(build, name="router", batch_size=4, fake=False)
    assert [(c.key, c.nbytes) for c in fake.candidates] == [(c.key, c.nbytes) for c in real.candidates]
    assert len(fake.candidates) >= 3


def test_keys_stable_and_fingerprints() -> None:
    a = capture(tiny_cnn_build(), name="cnn", batch_size=2, fake=True)
    b = capture(tiny_cnn_build(), name="cnn", batch_size=2, fake=True)
    assert [c.key for c in a.candidates] == [c.key for c in b.candidates]
    assert a.fingerprint == b.fingerprint and a.shape_fingerprint == b.shape_fingerprint
    bigger_batch = capture(tiny_cnn_build(batch=4), name="cnn", batch_size=4, fake=True)
    assert bigger_batch.fingerprint == a.fingerprint  # the structure did not change...
    assert bigger_batch.shape_fingerprint != a.shape_fingerprint  # ...the sizes did
    wider = capture(mlp_build(hidden=16), name="mlp", batch_size=3, fake=True)
    deeper = capture(mlp_build(layers=2), name="mlp", batch_size=3, fake=True)
    base = capture(mlp_build(), name="mlp", batch_size=3, fake=True)
    assert len({base.fingerprint, wider.fingerprint, deeper.fingerprint, a.fingerprint}) == 4


def test_candidate_lifetimes_are_consistent() -> None:
    w = capture(tiny_cnn_build(), name="cnn", batch_size=2, fake=True)
    fwd = w.phase_range(Phase.FORWARD)
    for c in w.candidates:
        t = w.tensors[c.tensor]
        assert t.kind == TensorKind.ACTIVATION and c.producer == t.alloc_op in fwd
        assert c.producer <= c.last_fwd_use <= c.free_if_dropped_op
        assert c.bwd_uses and all(w.ops[i].phase == Phase.BACKWARD for i in c.bwd_uses)
        assert t.free_op is not None and t.free_op >= c.bwd_uses[-1]
        assert c.tensor not in c.recompute_inputs


def test_save_load_roundtrip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    w = capture(tiny_cnn_build(), name="cnn", batch_size=2, fake=True)
    for name in ("w.json", "w.json.gz"):
        w.save(tmp_path / name)
        back = Workload.load(tmp_path / name)
        assert back == w
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.json", "w.json.gz"]  # no temp files left


def test_bad_workload_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    w = capture(mlp_build(), name="mlp", batch_size=3, fake=True)
    path = tmp_path / "w.json"
    w.save(path)
    text = path.read_text()
    (tmp_path / "trunc.json").write_text(text[: len(text) // 2])
    with pytest.raises(AutotuneError, match="not a workload file"):
        Workload.load(tmp_path / "trunc.json")
    d = json.loads(text)
    d["format"] = "autotune.workload/v0"
    (tmp_path / "old.json").write_text(json.dumps(d))
    with pytest.raises(AutotuneError, match=r"'autotune\.workload/v0' is not supported"):
        Workload.load(tmp_path / "old.json")
    d["format"] = "autotune.workload/v1"
    del d["ops"][0]["phase"]
    (tmp_path / "broken.json.gz").write_bytes(gzip.compress(json.dumps(d).encode()))
    with pytest.raises(AutotuneError, match="corrupted workload file"):
        Workload.load(tmp_path / "broken.json.gz")
    with pytest.raises(AutotuneError, match="cannot read workload file"):
        Workload.load(tmp_path / "missing.json")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_parameter_the_loss_never_reads_has_no_optimizer_state_in_a_fake_trace(optimizer: str) -> None:
    """NOTE [ Steady state ]: the fake warm-up gave every trainable parameter a zero gradient, so the optimizer
    made state for an unused head too, which real training never makes: the fake trace held its bytes and
    its shape fingerprint was not the real trace's (a QA run: ``simulate --save-policy`` wrote a policy that
    ``autotune train`` refused). Both traces now hold state for the used layer only."""

    class Unused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 300)  # never called

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        return Unused(), (torch.randn(4, 16),), lambda m, b: m(b[0]).square().mean()

    def state(w: Workload) -> int:
        return sum(t.nbytes for t in w.tensors if t.kind == TensorKind.OPTIMIZER_STATE)

    fake = capture(build, name="unused", batch_size=4, optimizer=optimizer)
    real = capture(build, name="unused", batch_size=4, optimizer=optimizer, fake=False)
    per_copy = (16 * 16 + 16) * 4  # the used layer's weight and bias: one momentum (SGD), or two moments (Adam)
    expected = per_copy if optimizer == "sgd" else 2 * per_copy + 2 * 4  # ... and Adam's step count per parameter
    assert state(fake) == state(real) == expected
    assert fake.shape_fingerprint == real.shape_fingerprint
