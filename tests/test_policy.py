"""Policy files: round trips, atomic saves, every validation failure, vectors and bytes on a tiny MLP."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime import load_policy
from runtime.errors import AutotuneError
from runtime.policy import (
    ACTIONS,
    FORMAT,
    Action,
    Policy,
    PolicyOptions,
    Prediction,
    schema,
)
from runtime.trace import capture
from runtime.workload import Workload
from tests.test_trace import mlp_build, tiny_cnn_build

# Sequential(Linear(4,8), ReLU, Linear(8,2)) at batch 3: see tests/test_trace.py::test_mlp_known_answers.
MLP_KEYS = ["1#0.0:Relu", "<loss>#0.0:LogSoftmax", "<loss>#0.2:nograd"]
MLP_BYTES = [96, 24, 4]


@pytest.fixture(scope="module")
def mlp() -> Workload:
    return capture(mlp_build(), name="mlp", batch_size=3, fake=True)


@pytest.fixture(scope="module")
def cnn() -> Workload:
    return capture(tiny_cnn_build(), name="cnn", batch_size=2, fake=True)


def make(w: Workload, vector: list[int], lossy: bool = False) -> Policy:
    p = Policy.from_vector(
        w, vector, hardware="a100-40gb", budget_bytes=900, options=PolicyOptions(lossy=lossy), searcher="test"
    )
    p.predicted = Prediction(peak_bytes=808, iter_s=0.0012, samples_per_s=2500.0)
    return p


def write(path: Path, d: dict[str, Any]) -> Path:
    path.write_text(json.dumps(d))
    return path


def test_mlp_candidates_are_as_expected(mlp: Workload) -> None:
    assert [(c.key, c.nbytes) for c in mlp.candidates] == list(zip(MLP_KEYS, MLP_BYTES, strict=True))


def test_round_trip(tmp_path: Path, mlp: Workload) -> None:
    p = make(mlp, [3, 1, 0], lossy=True)
    p.measured = Prediction(peak_bytes=812, iter_s=0.0015, samples_per_s=2000.0)
    p.provenance.wall_s = 1.25
    p.save(tmp_path / "p.json")
    back = load_policy(tmp_path / "p.json", mlp)
    assert back == p
    assert back.actions == {MLP_KEYS[0]: Action.COMPRESS, MLP_KEYS[1]: Action.SWAP, MLP_KEYS[2]: Action.KEEP}
    assert Policy.from_dict(p.to_dict()) == p


def test_file_is_sorted_pretty_json(tmp_path: Path, mlp: Workload) -> None:
    make(mlp, [1, 0, 0]).save(tmp_path / "p.json")
    text = (tmp_path / "p.json").read_text()
    d = json.loads(text)
    assert d["format"] == FORMAT == "autotune.policy/v1"
    assert text == json.dumps(d, indent=2, sort_keys=True) + "\n"  # stable text: diffs show real changes
    assert d["actions"] == {MLP_KEYS[0]: "swap", MLP_KEYS[1]: "keep", MLP_KEYS[2]: "keep"}
    assert d["provenance"]["searcher"] == "test" and d["provenance"]["created"].endswith("Z")


def test_save_is_atomic(tmp_path: Path, mlp: Workload, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.json"
    make(mlp, [0, 0, 0]).save(path)
    before = path.read_bytes()

    def fail(src: Any, dst: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        make(mlp, [2, 2, 2]).save(path)
    assert path.read_bytes() == before
    assert [q.name for q in tmp_path.iterdir()] == ["p.json"]  # no temp file left


def test_vectors_and_uniform(mlp: Workload) -> None:
    vector = np.array([2, 1, 0])
    p = Policy.from_vector(mlp, vector, hardware="cpu")
    assert p.to_vector(mlp).dtype == np.int8 and p.to_vector(mlp).tolist() == [2, 1, 0]
    assert [a.code for a in ACTIONS] == [0, 1, 2, 3] and Action.RECOMPUTE.code == 2
    assert (p.model, p.batch_size, p.fingerprint) == ("mlp", 3, mlp.fingerprint)
    keep = Policy.uniform(mlp, Action.KEEP, hardware="cpu")
    assert keep.to_vector(mlp).tolist() == [0, 0, 0] and keep.provenance.searcher == "uniform"
    assert keep.counts() == {Action.KEEP: 3, Action.SWAP: 0, Action.RECOMPUTE: 0, Action.COMPRESS: 0}
    with pytest.raises(ValueError, match="2 entries but mlp has 3 candidates"):
        Policy.from_vector(mlp, [0, 1], hardware="cpu")
    with pytest.raises(ValueError, match=r"\[0, 4\] are not all integers in 0..3"):
        Policy.from_vector(mlp, [0, 4, 0], hardware="cpu")


def test_counts_and_bytes(mlp: Workload) -> None:
    p = make(mlp, [1, 2, 1])
    assert p.counts() == {Action.KEEP: 0, Action.SWAP: 2, Action.RECOMPUTE: 1, Action.COMPRESS: 0}
    assert p.bytes_by_action(mlp) == {
        Action.KEEP: 0,
        Action.SWAP: 96 + 4,
        Action.RECOMPUTE: 24,
        Action.COMPRESS: 0,
    }
    everything = Policy.uniform(mlp, Action.COMPRESS, hardware="cpu", options=PolicyOptions(lossy=True))
    assert everything.bytes_by_action(mlp)[Action.COMPRESS] == sum(MLP_BYTES) == mlp.activation_bytes


def test_compress_needs_lossy(tmp_path: Path, mlp: Workload) -> None:
    with pytest.raises(AutotuneError, match=r"1 tensor would be compressed \('1#0.0:Relu'\).*\"lossy\": true"):
        make(mlp, [3, 0, 0])
    with pytest.raises(AutotuneError, match=r"options\.lossy is false"):
        Policy.uniform(mlp, Action.COMPRESS, hardware="cpu")
    d = make(mlp, [3, 0, 0], lossy=True).to_dict()
    d["options"]["lossy"] = False
    with pytest.raises(AutotuneError, match=r"p\.json: options\.lossy is false but 1 tensor would be"):
        load_policy(write(tmp_path / "p.json", d))


def test_unreadable_and_not_json(tmp_path: Path) -> None:
    with pytest.raises(
        AutotuneError, match=r"cannot read policy file '.*missing\.json': No such file.*; check the path"
    ):
        load_policy(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"format": "autotune.policy/v1", "actions": {')
    with pytest.raises(AutotuneError, match=r"'.*bad\.json' is not a policy file \(not valid JSON"):
        load_policy(tmp_path / "bad.json")
    (tmp_path / "dup.json").write_text('{"actions": {"a": "keep", "a": "swap"}}')
    with pytest.raises(AutotuneError, match=r"dup\.json: key 'a' appears twice in one object"):
        load_policy(tmp_path / "dup.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(
        AutotuneError, match=r"cannot read policy file .*not UTF-8 text; search a new one with `autotune search"
    ):
        load_policy(tmp_path / "bin.json")
    # A folder: "Is a directory" said nothing of what to give (a QA run); the file in it is named.
    with pytest.raises(AutotuneError, match=r"Is a directory; give a policy file, not a folder$"):
        load_policy(tmp_path)
    (tmp_path / "resnet18.policy.json").write_text("{}")
    with pytest.raises(AutotuneError, match=r"Is a directory; give a policy file, e\.g\. .*resnet18\.policy\.json$"):
        load_policy(tmp_path)


def test_wrong_format(tmp_path: Path, mlp: Workload) -> None:
    d = make(mlp, [0, 0, 0]).to_dict()
    d["format"] = "autotune.policy/v0"
    with pytest.raises(AutotuneError, match=r"format 'autotune.policy/v0' is not supported: expected 'autotune"):
        load_policy(write(tmp_path / "p.json", d))
    del d["format"]
    with pytest.raises(AutotuneError, match=r'no "format" field: expected "format": "autotune.policy/v1"'):
        load_policy(write(tmp_path / "p.json", d))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(AutotuneError, match=r"list\.json: the file holds a JSON list, not an object"):
        load_policy(tmp_path / "list.json")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["actions"].update({"1#0.0:Relu": "swapp"}),
            r"p\.json: actions\.1#0\.0:Relu: 'swapp' is not one of "
            r"\['keep', 'swap', 'recompute', 'compress'\]",
        ),
        (lambda d: d.update(budget=5), r"p\.json: top level: .*'budget' was unexpected"),
        (lambda d: d["options"].update(prefetch=3), r"p\.json: options: .*'prefetch' was unexpected"),
        (
            lambda d: d["options"].update(compress_dtype="int8"),
            r"options\.compress_dtype: 'int8' is not one of",
        ),
        (
            lambda d: d["options"].update(prefetch_lookahead=-1),
            r"options\.prefetch_lookahead: -1 is less than",
        ),
        (lambda d: d.update(batch_size="64"), r"batch_size: '64' is not of type 'integer'"),
        # accepted by the schema, and trained at batch 2.0 (the CLI refused it with a message about a flag)
        (lambda d: d.update(batch_size=2.0), r"batch_size: 2\.0 is not an integer: write it 2"),
        # policy.applied trained with it as if it kept everything, without a word
        (lambda d: d.update(actions={}), r'p\.json: "actions" is empty: a policy has one action per tensor'),
        (lambda d: d["predicted"].pop("iter_s"), r"predicted: .*'iter_s' is a required property"),
        (
            lambda d: d["provenance"].update(created="yesterday"),
            r"provenance\.created: 'yesterday' does not match",
        ),
        (lambda d: d.pop("fingerprint"), r"top level: 'fingerprint' is a required property"),
        (
            lambda d: d.update(batch_size=0, seq_len=0),
            r"(batch_size: 0|seq_len: 0) is less than the minimum of 1 \(and 1 more problem\)",
        ),
        # Inside a field that may be null: the object's own error, not "not valid under any of the given
        # schemas" with the whole schedule printed (2.8 KB on one line).
        (
            lambda d: d.update(schedule={"regions": [{"module": "nope"}], "ignored_keys": [], "unpack_rank": {}}),
            r"schedule\.regions\.0: 'call' is a required property$",
        ),
        (lambda d: d.update(schedule={"foo": 1}), r"schedule: .*'foo' was unexpected"),
        (lambda d: d.update(predicted={"iter_s": "slow"}), r"predicted\.iter_s: 'slow' is not of type"),
    ],
)
def test_schema_violations(tmp_path: Path, mlp: Workload, edit: Any, message: str) -> None:
    d = make(mlp, [1, 0, 0]).to_dict()
    edit(d)
    with pytest.raises(AutotuneError, match=message):
        load_policy(write(tmp_path / "p.json", d))


def test_other_model_is_refused(tmp_path: Path, mlp: Workload, cnn: Workload) -> None:
    make(mlp, [1, 0, 0]).save(tmp_path / "p.json")
    msg = (
        rf"p\.json: policy was made for mlp \(fingerprint {mlp.fingerprint}\) but the workload is cnn "
        rf"\(fingerprint {cnn.fingerprint}\); search a policy for this model with "
        r"`autotune search --model cnn"
    )
    with pytest.raises(AutotuneError, match=msg):
        load_policy(tmp_path / "p.json", cnn)
    wider = capture(mlp_build(hidden=16), name="mlp", batch_size=3, fake=True)
    with pytest.raises(AutotuneError, match="same name, other structure: the model changed"):
        load_policy(tmp_path / "p.json", wider)


def test_keys_must_match(tmp_path: Path, mlp: Workload) -> None:
    d = make(mlp, [1, 0, 0]).to_dict()
    d["actions"].update({f"ghost{i}#0.0:Relu": "keep" for i in range(5)})
    with pytest.raises(
        AutotuneError,
        match=r"actions name 5 tensors that mlp does not save \('ghost0#0.0:Relu', "
        r"'ghost1#0.0:Relu', 'ghost2#0.0:Relu' and 2 more\); remove them",
    ):
        load_policy(write(tmp_path / "p.json", d), mlp)
    d = make(mlp, [1, 0, 0]).to_dict()
    del d["actions"]["<loss>#0.0:LogSoftmax"], d["actions"]["1#0.0:Relu"]
    path = write(tmp_path / "p.json", d)
    load_policy(path)  # the file alone is valid...
    with pytest.raises(AutotuneError, match=r"no action for 2 candidates of mlp \('1#0.0:Relu', '<loss>#0"):
        load_policy(path, mlp)  # ...but not for this workload
    with pytest.raises(AutotuneError, match="no action for"):
        load_policy(path).to_vector(mlp)


def test_counts_over_a_workload_are_the_actions_it_applies(mlp: Workload) -> None:
    """A file with an action for a tensor the model does not save (tolerated, warned): its own counts hold it,
    the workload's do not (simulate's summary said "72 recompute" for 71 applied, a QA run)."""
    d = make(mlp, [2, 0, 0]).to_dict()
    d["actions"]["ghost#0.0:Relu"] = "recompute"
    p = Policy.from_dict(d)
    assert p.counts()[Action.RECOMPUTE] == 2 and p.counts(mlp)[Action.RECOMPUTE] == 1
    assert sum(p.counts(mlp).values()) == len(mlp.candidates) == p.counts(mlp)[Action.KEEP] + 1


def test_other_batch_size(tmp_path: Path, cnn: Workload) -> None:
    make(cnn, [0] * len(cnn.candidates)).save(tmp_path / "p.json")
    bigger = capture(tiny_cnn_build(batch=4), name="cnn", batch_size=4, fake=True)
    msg = r"policy was made for cnn at batch size 2 but the workload is at batch size 4 .*--batch-size 4"
    with pytest.raises(AutotuneError, match=msg):
        load_policy(tmp_path / "p.json", bigger)
    p = load_policy(tmp_path / "p.json", bigger, allow_other_shapes=True)
    assert p.batch_size == 2 and p.to_vector(bigger).tolist() == [0] * len(bigger.candidates)


def test_an_optimizer_edited_by_hand_is_named_in_the_refusal(tmp_path: Path, cnn: Workload) -> None:
    """A file whose optimizer was edited (sgd -> adam) is refused by its shape fingerprint, which counts Adam's
    state; the message blamed the batch_size, seq_len and image_size fields alone (a QA run)."""
    make(cnn, [0] * len(cnn.candidates)).save(tmp_path / "p.json")
    d = json.loads((tmp_path / "p.json").read_text())
    (tmp_path / "p.json").write_text(json.dumps({**d, "optimizer": "adam"}))
    adam = capture(tiny_cnn_build(), name="cnn", batch_size=2, fake=True, optimizer="adam")
    msg = r"at batch size 2 \(its batch_size, seq_len and image_size fields; with adam and 1 micro-batch a step, "
    with pytest.raises(AutotuneError, match=msg + r".*the file's fields disagree"):
        load_policy(tmp_path / "p.json", adam)


def test_a_batch_size_no_tensor_can_have_is_refused_by_the_schema(tmp_path: Path, cnn: Workload) -> None:
    """A batch size of 1e23 passed the schema and came out as PyTorch's C++ error text with its frames (a QA run)."""
    make(cnn, [0] * len(cnn.candidates)).save(tmp_path / "p.json")
    d = json.loads((tmp_path / "p.json").read_text())
    (tmp_path / "p.json").write_text(json.dumps({**d, "batch_size": 99999999999999999999999}))
    with pytest.raises(AutotuneError, match="batch_size") as e:
        load_policy(tmp_path / "p.json")
    assert "\n" not in str(e.value) and "c10" not in str(e.value)


def test_schema_is_valid() -> None:
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(schema())
    assert schema()["properties"]["format"]["const"] == FORMAT
    assert schema()["properties"]["actions"]["additionalProperties"]["enum"] == [a.value for a in ACTIONS]
    assert set(schema()["properties"]) == set(Policy.__dataclass_fields__) | {"format"}


def test_options_are_checked() -> None:
    with pytest.raises(AutotuneError, match=r"compress_dtype='int8' is not supported"):
        PolicyOptions(compress_dtype="int8")
    with pytest.raises(AutotuneError, match="prefetch_lookahead=-1 is negative"):
        PolicyOptions(prefetch_lookahead=-1)


def test_a_producer_named_otherwise_by_another_pytorch_is_the_same_key(tmp_path: Path) -> None:
    """NOTE [ Key format ]: a tensor made by ``_unsafe_view`` (torch 2.14's ``reshape`` in
    ``F.multi_head_attention_forward``) and one made by ``view`` (torch 2.11's ``contiguous().view`` there) get one
    key, and a policy file written with the older ``:UnsafeView`` name loads with the key the runtime makes."""
    import torch

    from runtime.keys import canonical_key, producer_name

    x = torch.ones(2, 3, requires_grad=True) * 2
    assert producer_name(torch.ops.aten._unsafe_view(x, [6])) == producer_name(x.view(6)) == "View"
    assert canonical_key("a.b#0.6:UnsafeView") == "a.b#0.6:View" == canonical_key("a.b#0.6:View")
    assert canonical_key("a.b#0.6:nograd") == "a.b#0.6:nograd"

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)  # on a 3-D input: matmul's _unsafe_view
            return (h * h).sum()

    def build():  # type: ignore[no-untyped-def]
        return Net(), torch.ones(2, 4, 8), lambda m, b: m(b)

    w = capture(build, name="net", batch_size=2)
    assert [c.key for c in w.candidates] == ["<root>#0.0:View"]
    d = make(w, [1] * len(w.candidates)).to_dict()
    d["actions"] = {k.replace(":View", ":UnsafeView"): a for k, a in d["actions"].items()}  # an older file
    policy = load_policy(write(tmp_path / "p.json", d), w)
    assert (policy.to_vector(w) == Action.SWAP.code).all()


def test_a_view_an_in_place_op_changed_has_one_key_in_fake_and_real_steps() -> None:
    """NOTE [ Key format ]: EfficientNet's classifier flattens, then drops out in place, then its linear layer
    saves the flattened view. Autograd makes that view's node again after the in-place op: AsStrided on real
    tensors, the view op itself on fake ones (they record how to replay a view). A fake trace named it View,
    the runtime AsStrided, and every step kept it as a tensor the policy does not know."""
    import warnings

    import torch

    from runtime.apply import PolicyRuntime
    from runtime.hardware import get_profile

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.pool = torch.nn.AdaptiveAvgPool2d(1)
            self.head = torch.nn.Sequential(torch.nn.Dropout(0.2, inplace=True), torch.nn.Linear(8, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        batch = (torch.randn(2, 3, 8, 8), torch.tensor([0, 3]))
        return Net(), batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])

    w = capture(build, name="net", batch_size=2, target=get_profile("a100-40gb"))
    assert "head.1#0.0:View" in {c.key for c in w.candidates}
    policy = make(w, [Action.SWAP.code] * len(w.candidates))
    model, batch, loss_fn = build()
    rt = PolicyRuntime(policy, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tensor not in the policy warns
        for _ in range(2):
            with rt.step():
                loss_fn(model, batch).backward()
    assert rt.stats.swaps > 0 and not rt.stats.unknown_keys


def test_keys_from_another_device_are_tolerated_when_most_agree(tmp_path: Path, cnn: Workload) -> None:
    """NOTE [ Keys across devices ]: a CUDA trace saves a few other tensors than a CPU one."""
    d = make(cnn, [1] * len(cnn.candidates)).to_dict()
    gone = cnn.candidates[0].key
    del d["actions"][gone]
    d["actions"]["attn#0.2:ScaledDotProductEfficientAttention"] = "swap"
    path = write(tmp_path / "p.json", d)
    with pytest.warns(UserWarning, match=r"1 candidate of cnn without an action \(kept: .*1 action for tensors"):
        policy = load_policy(path, cnn)
    vec = policy.to_vector(cnn)
    assert vec[0] == Action.KEEP.code and all(v == Action.SWAP.code for v in vec[1:])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_figure_that_is_no_number_is_refused(tmp_path: Path, mlp: Workload, value: float) -> None:
    """``"samples_per_s": NaN`` passed the schema (JSON's numbers, as Python reads them) and loaded."""
    path = tmp_path / "p.json"
    policy = Policy.uniform(mlp, Action.KEEP, hardware="a100-40gb")
    policy.predicted = Prediction(1000, 0.5, 2.0)
    policy.save(path)
    data = json.loads(path.read_text())
    data["predicted"]["samples_per_s"] = value
    path.write_text(json.dumps(data))
    with pytest.raises(AutotuneError, match=r"samples_per_s=.*expected a finite number"):
        load_policy(path)


def test_a_policy_says_which_compiled_step_it_was_planned_for(tmp_path: Path) -> None:
    """Made on the simulator's twin of a compiled step (Rule 16), a policy records the backend; the file keeps
    it (and the schema admits it); a policy for the eager runtime writes no such field, as files always were."""
    from envs.simulator import compiled_twin
    from tests.synthetic import fixed_profile, two_op_chain_workload

    w = two_op_chain_workload(3, 1000, 1e-4)
    tw, _ = compiled_twin(w, fixed_profile(), "aot_eager")
    eager = Policy.from_vector(w, np.zeros(3, dtype=np.int8), hardware="fixed")
    compiled = Policy.from_vector(tw, np.full(3, 2, dtype=np.int8), hardware="fixed")
    assert eager.compile_backend is None and "compile_backend" not in eager.to_dict()
    assert compiled.compile_backend == "aot_eager" and compiled.actions.keys() == eager.actions.keys()
    compiled.save(tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["compile_backend"] == "aot_eager"
    assert load_policy(tmp_path / "p.json").compile_backend == "aot_eager"
    d = compiled.to_dict()
    d["compile_backend"] = ""
    with pytest.raises(AutotuneError, match="compile_backend"):
        Policy.from_dict(d)
