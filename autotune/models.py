"""The model zoo: a training workload (module, synthetic batch, loss) by name.

``build_model`` turns a name into a :class:`ModelEntry`: a module in train mode, a synthetic batch on the
requested device and a ``loss_fn`` that runs forward and loss. Three kinds of names are accepted:

- every torchvision classification model (``resnet101``, ``vit_b_16``, ``swin_t``, ...), built with
  ``weights=None``; batch = (images ``(B, 3, H, W)``, labels ``(B,)``);
- GPT-2 (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``) and BERT (``bert-base``, alias
  ``bert-base-uncased``), built from transformers config objects made here; batch = token ids (and for BERT
  an attention mask) plus labels;
- a model of your own, ``package.module:factory`` (see :func:`build_model` for the factory contract).

Nothing is ever downloaded. Everything works under ``FakeTensorMode``, which is how the tracer builds
workloads without memory (see NOTE [ Building under FakeTensorMode ]). transformers and torchvision are
imported on first use: importing this module costs only torch.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from runtime.errors import AutotuneError, one_line
from runtime.vocab import Batch, LossFn, batch_tensors

__all__ = ["LossFn", "ModelEntry", "build_model", "default_batch_size", "list_models"]


# name -> GPT2Config sizes: layers and widths from Radford et al. 2019, table 2; heads from the released
# checkpoints' configs (64 dimensions per head).
_GPT2_SIZES: dict[str, dict[str, int]] = {
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "gpt2-medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
    "gpt2-large": {"n_layer": 36, "n_embd": 1280, "n_head": 20},
    "gpt2-xl": {"n_layer": 48, "n_embd": 1600, "n_head": 25},
}
# accepted name -> canonical name; BertConfig() defaults are bert-base-uncased.
_BERT_NAMES: dict[str, str] = {"bert-base": "bert-base", "bert-base-uncased": "bert-base"}

_IMAGE_SIZE = 224
_IMAGE_SIZE_OVERRIDES = {"inception_v3": 299}  # its auxiliary classifier needs at least 299 px
_NUM_CLASSES = 1000  # torchvision's default head (ImageNet-1k)
_IMAGE_BATCH_SIZE = 64
_LM_BATCH_SIZE = 8
_CUSTOM_BATCH_SIZE = 8  # for a factory whose batch_size parameter has no default

# GoogLeNet and Inception v3 train with auxiliary classifiers; each adds this weight times its cross
# entropy (Szegedy et al. 2015, "Going deeper with convolutions", section 5).
_AUX_LOSS_WEIGHT = 0.3
_IGNORE_INDEX = -100  # the label that cross entropy skips (torch's and transformers' default)
_MLM_MASK_FRACTION = 0.15  # share of positions masked for BERT (Devlin et al. 2019, section 3.1)
_BERT_MASK_TOKEN_ID = 103  # [MASK] in bert-base-uncased's vocabulary


@dataclass(frozen=True, eq=False)
class ModelEntry:
    """One training workload: run ``loss_fn(module, batch).backward()`` for one iteration.

    ``module`` is in train mode; ``batch`` is on the device the entry was built for; ``batch_size`` is the
    number of samples in ``batch``; ``seq_len`` the tokens per sample for language models (None otherwise);
    ``image_size`` the image height and width for torchvision models (None otherwise).
    """

    name: str
    family: str  # "torchvision", "gpt2", "bert" or "custom"
    module: nn.Module
    batch: Batch  # a tuple of tensors, or a mapping of keyword arguments (``module(**batch)``)
    loss_fn: LossFn
    batch_size: int
    seq_len: int | None
    image_size: int | None = None

    def samples(self) -> int:
        """Samples processed per iteration (the unit of throughput)."""
        return self.batch_size


def list_models() -> list[str]:
    """Every built-in name :func:`build_model` accepts, aliases included, sorted."""
    return sorted([*_torchvision_names(), *_GPT2_SIZES, *_BERT_NAMES])


def default_batch_size(name: str) -> int:
    """A sensible batch size for ``name``: 64 for torchvision models at 224 px, 8 for GPT-2 and BERT.

    For a ``package.module:factory`` name this is 8, used only when the factory's ``batch_size`` parameter
    has no default of its own. Raises AutotuneError for an unknown name.
    """
    family, _ = _resolve(name)
    return {"torchvision": _IMAGE_BATCH_SIZE, "custom": _CUSTOM_BATCH_SIZE}.get(family, _LM_BATCH_SIZE)


def build_model(
    name: str,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    image_size: int | None = None,
    config_overrides: Mapping[str, Any] | None = None,
) -> ModelEntry:
    """Build the module, a synthetic batch and the loss for ``name``.

    Args:
        name: a name from :func:`list_models` (case-insensitive) or ``package.module:factory``.
        batch_size: samples per batch; None picks :func:`default_batch_size` (for a factory, see below).
        seq_len: tokens per sample, language models only; default and maximum: the model's positions
            (1024 for GPT-2, 512 for BERT).
        device: where parameters and batch live. Modules are built directly there.
        dtype: floating-point dtype of parameters, buffers and floating batch tensors.
        seed: seeds every random number drawn here (weights and batch) without touching the caller's RNG
            state: the same seed gives identical parameters and batch.
        image_size: image height and width for torchvision models; default 224 (299 for inception_v3).
            It must suit the architecture: ViTs need a multiple of their patch size, maxvit_t a multiple of
            224, inception_v3 at least 299.
        config_overrides: torchvision: keyword arguments for the builder (e.g. ``num_classes``); GPT-2 and
            BERT: fields of the transformers config (e.g. ``{"n_layer": 2}``); a factory: keyword
            arguments for it.

    A factory ``package.module:factory`` is imported and called with ``batch_size=`` if it has a parameter
    of that name (``seq_len=``, ``image_size=`` and ``config_overrides`` likewise, when given), else with no
    arguments. It returns ``(module, batch)`` or ``(module, batch, loss_fn)``, where ``batch`` is a tensor,
    a tuple of tensors or a dict of tensors (keyword arguments, as the Hugging Face Trainer feeds a model:
    ``module(**batch)``), and ``loss_fn(module, batch)`` returns a scalar tensor. Without ``loss_fn`` every
    batch tensor is an input. For a dict whose output has a ``loss`` (a transformers model given its
    ``labels``), the loss is ``module(**batch).loss``. Otherwise it is the output (its first tensor if it
    returns several) ``.float().square().mean()``, a stand-in whose backward, like a real loss's, sends a
    full-size gradient into the output. With ``batch_size=None`` a factory gets its own ``batch_size``
    default (8 if it has none); one without a ``batch_size`` parameter decides the batch size itself (the
    first dimension of its batch's first tensor), and an explicit ``batch_size`` must then match its batch.
    The factory runs with ``device`` as default device and ``dtype`` as default dtype; tensors it puts
    elsewhere are moved there (outside FakeTensorMode only).

    Raises:
        AutotuneError: for an unknown name, a bad size, device or dtype, or a factory that cannot be
            imported, raises, or returns something else.
    """
    family, canonical = _resolve(name)
    _check_positive("batch_size", batch_size, allow_none=True)
    _check_positive("seq_len", seq_len, allow_none=True)
    _check_positive("image_size", image_size, allow_none=True)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise AutotuneError(f"seed={seed!r} is not an integer: pass an int such as seed=0")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise AutotuneError(
            f"dtype={dtype!r} is not a floating-point torch dtype: pass e.g. torch.float32 or torch.bfloat16"
        )
    dev = _parse_device(device)
    overrides = dict(config_overrides or {})
    if family != "custom":
        if "weights" in overrides:
            raise AutotuneError(
                f"config_overrides sets weights={overrides['weights']!r}: autotune builds models with "
                "random weights and never downloads any; remove that key"
            )
        if family == "torchvision" and seq_len is not None:
            raise AutotuneError(
                f"seq_len={seq_len} given for image model {canonical!r}: seq_len only applies to language "
                "models (gpt2*, bert-base); leave it unset"
            )
        if family != "torchvision" and image_size is not None:
            raise AutotuneError(
                f"image_size={image_size} given for language model {canonical!r}: image_size only applies "
                "to torchvision models; use seq_len to size a language model's batch"
            )

    # See NOTE [ Building under FakeTensorMode ]. Tensors are created on `dev` in `dtype` (the default
    # dtype for the build), so modules are born where and as they will run, never converted afterwards.
    with _seeded(seed, dev), _fake_mode_fixes(family), torch.device(dev), _default_dtype(dtype):
        try:
            if family == "torchvision":
                entry = _build_torchvision(canonical, batch_size, image_size, dtype, overrides)
            elif family == "gpt2":
                entry = _build_gpt2(canonical, batch_size, seq_len, overrides)
            elif family == "bert":
                entry = _build_bert(canonical, batch_size, seq_len, overrides)
            else:
                entry = _build_custom(canonical, batch_size, seq_len, image_size, dev, dtype, overrides)
        except (RuntimeError, MemoryError) as exc:  # a size the device's memory (or a tensor's size) cannot hold
            said = str(exc).lower()
            if not isinstance(exc, MemoryError) and not any(s in said for s in ("allocate", "overflow", "memory")):
                raise
            given = (("--batch-size", batch_size), ("--image-size", image_size), ("--seq-len", seq_len))
            sizes = " ".join(f"{flag} {v}" for flag, v in given if v is not None)
            raise AutotuneError(
                f"{canonical} could not be built with its batch{' at ' + sizes if sizes else ''} on {dev.type}: "
                f"{type(exc).__name__}: {one_line(exc)}; choose smaller sizes"
            ) from exc
    _move_module(entry, dev, dtype)
    entry.module.train()
    return entry


# ----------------------------------------------------------------------------------------------------------
# Names


@functools.cache
def _torchvision_names() -> tuple[str, ...]:
    # Classification builders only: list_models(module=torchvision.models) leaves out detection,
    # segmentation, video, optical flow and quantized models, whose inputs and targets are not (images,
    # class labels).
    return tuple(_import("torchvision").models.list_models(module=_import("torchvision.models")))


def check_model_name(name: str) -> None:
    """Refuse an unknown model name, or a factory that cannot be imported, before any long work (a factory's
    module is imported: what building the model does first)."""
    family, path = _resolve(name)
    if family == "custom":
        _load_factory(path)


def takes_seq_len(name: str) -> bool:
    """Whether ``--seq-len`` applies to ``name`` (language models and factories; not torchvision)."""
    return _resolve(name)[0] != "torchvision"


def takes_image_size(name: str) -> bool:
    """Whether ``--image-size`` applies to ``name`` (torchvision models and factories; not GPT-2 or BERT)."""
    return _resolve(name)[0] in ("torchvision", "custom")


def check_factory_accepts(name: str, **settings: Any) -> None:
    """Refuse, before any long work, a setting (``seq_len``, ``image_size``) that a factory ``name`` has no
    parameter for; built-in names pass (their own checks are :func:`build_model`'s)."""
    family, path = _resolve(name)
    if family == "custom":
        _factory_settings(path, _parameters(_load_factory(path)), settings)


def _parameters(factory: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some builtins and C extensions have no signature
        return {}


def _factory_settings(
    path: str, params: Mapping[str, inspect.Parameter], settings: Mapping[str, Any]
) -> dict[str, Any]:
    """The keyword arguments a factory is called with: the settings given (not None), each one it takes."""
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    for key, value in settings.items():
        if value is None:
            continue
        if key not in params and not takes_kwargs:
            raise AutotuneError(
                f"{key}={value!r} given for {path}, but the factory has no {key} parameter: add one to it "
                "or leave that setting out"
            )
        kwargs[key] = value
    return kwargs


def given_image_size(name: str, image_size: int | None) -> int | None:
    """The image size a trace records: ``image_size``, or None where it is the model's default (224 px, 299
    for inception_v3), so that a plan made without ``--image-size`` and one made with the default size are
    the same plan. A factory's size is recorded as given (its default is its own)."""
    family, canonical = _resolve(name)
    if family == "torchvision" and image_size == _IMAGE_SIZE_OVERRIDES.get(canonical, _IMAGE_SIZE):
        return None
    return image_size


def _resolve(name: str) -> tuple[str, str]:
    """(family, canonical name) for ``name``, or AutotuneError with close matches."""
    if not isinstance(name, str):
        raise AutotuneError(f"model name {name!r} is not a string: pass e.g. 'resnet101'")
    if ":" in name:
        return "custom", _check_factory_path(name)
    key = name.strip().lower()
    if key in _GPT2_SIZES:
        return "gpt2", key
    if key in _BERT_NAMES:
        return "bert", _BERT_NAMES[key]
    if key in _torchvision_names():
        return "torchvision", key
    if "." in key:
        raise AutotuneError(
            f"unknown model {name!r}: a model of your own is named package.module:factory, with a colon "
            "before the factory (e.g. mypkg.models:make_model)"
        )
    close = difflib.get_close_matches(key, list_models(), n=3, cutoff=0.6)
    hint = f": did you mean {', '.join(close)}?" if close else "."
    raise AutotuneError(
        f"unknown model {name!r}{hint} See `autotune models` for the list, or pass your own as package.module:factory"
    )


def _check_factory_path(path: str) -> str:
    module_name, _, attr = path.partition(":")
    if ":" in attr or not attr.isidentifier() or not all(p.isidentifier() for p in module_name.split(".")):
        raise AutotuneError(
            f"malformed model path {path!r}: expected package.module:factory with one colon, dotted module "
            "and a factory name that are Python identifiers (e.g. mypkg.models:make_model)"
        )
    return path


# ----------------------------------------------------------------------------------------------------------
# Builders. Each runs inside build_model's seeded, device-scoped context.


def _build_torchvision(
    name: str, batch_size: int | None, image_size: int | None, dtype: torch.dtype, overrides: dict[str, Any]
) -> ModelEntry:
    torchvision = _import("torchvision")
    batch_size = _IMAGE_BATCH_SIZE if batch_size is None else batch_size
    size = image_size or _IMAGE_SIZE_OVERRIDES.get(name, _IMAGE_SIZE)
    kwargs: dict[str, Any] = {}
    if name in ("googlenet", "inception_v3"):
        kwargs["init_weights"] = True  # the default; saying so silences a FutureWarning from torchvision
    if image_size is not None and name.startswith("vit_"):
        kwargs["image_size"] = image_size  # ViTs size their position embedding for one resolution
    if image_size is not None and name == "maxvit_t":
        kwargs["input_size"] = (image_size, image_size)
    kwargs.update(overrides)
    builder = functools.partial(torchvision.models.get_model, name, weights=None, **kwargs)
    module = _call_builder(builder, f"torchvision's {name} builder", image_size, overrides)
    num_classes = int(overrides.get("num_classes", _NUM_CLASSES))
    images = torch.randn(batch_size, 3, size, size, dtype=dtype)  # (B, 3, H, W)
    labels = torch.randint(0, num_classes, (batch_size,))  # (B,) int64 class indices
    return ModelEntry(name, "torchvision", module, (images, labels), _classification_loss, batch_size, None, size)


def _build_gpt2(name: str, batch_size: int | None, seq_len: int | None, overrides: dict[str, Any]) -> ModelEntry:
    transformers = _import("transformers")
    fields: dict[str, Any] = {
        **_GPT2_SIZES[name],
        "vocab_size": 50257,
        "n_positions": 1024,
        # "sdpa" (torch.nn.functional.scaled_dot_product_attention) is transformers' default, needs no
        # extra package, runs on the CPU and traces under FakeTensorMode. "eager" would keep the
        # (B, nh, T, T) attention probabilities for backward on every device and overstate the memory of
        # training as people run it, where SDPA picks flash or memory-efficient kernels on a GPU.
        "attn_implementation": "sdpa",
        # Training: a KV cache would keep every layer's keys and values alive for nothing.
        "use_cache": False,
    }
    config = _make_config(transformers.GPT2Config, name, fields, overrides)
    seq_len = _check_seq_len(name, seq_len, config.n_positions, "n_positions")
    module = _call_builder(
        lambda: transformers.GPT2LMHeadModel(config),
        f"transformers' GPT2LMHeadModel for {name}",
        None,
        overrides,
    )
    batch_size = _LM_BATCH_SIZE if batch_size is None else batch_size
    input_ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))  # (B, T)
    # A separate labels tensor, as transformers' language-modelling collator makes one.
    labels = input_ids.clone()
    return ModelEntry(name, "gpt2", module, (input_ids, labels), _causal_lm_loss, batch_size, seq_len)


def _build_bert(name: str, batch_size: int | None, seq_len: int | None, overrides: dict[str, Any]) -> ModelEntry:
    transformers = _import("transformers")
    # Same attention choice as GPT-2 (see _build_gpt2).
    config = _make_config(transformers.BertConfig, name, {"attn_implementation": "sdpa"}, overrides)
    seq_len = _check_seq_len(name, seq_len, config.max_position_embeddings, "max_position_embeddings")
    module = _call_builder(
        lambda: transformers.BertForMaskedLM(config),
        f"transformers' BertForMaskedLM for {name}",
        None,
        overrides,
    )
    batch_size = _LM_BATCH_SIZE if batch_size is None else batch_size
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len))  # (B, T)
    # Mask exactly round(15%) positions of every sequence (at least one, so the loss is never an empty
    # mean): the first n_masked of a random permutation of positions. All become [MASK] (BERT's 10% random
    # and 10% unchanged tokens make no difference to memory or time).
    n_masked = max(1, round(_MLM_MASK_FRACTION * seq_len))
    order = torch.rand(batch_size, seq_len, dtype=torch.float32).argsort(dim=1)  # (B, T) permutation per row
    masked = torch.zeros(batch_size, seq_len, dtype=torch.bool).scatter_(1, order[:, :n_masked], True)
    labels = torch.where(masked, tokens, _IGNORE_INDEX)  # predict the original token where masked
    input_ids = torch.where(masked, min(_BERT_MASK_TOKEN_ID, config.vocab_size - 1), tokens)
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    batch = (input_ids, attention_mask, labels)
    return ModelEntry("bert-base", "bert", module, batch, _masked_lm_loss, batch_size, seq_len)


def _build_custom(
    path: str,
    batch_size: int | None,
    seq_len: int | None,
    image_size: int | None,
    device: torch.device,
    dtype: torch.dtype,
    overrides: dict[str, Any],
) -> ModelEntry:
    factory = _load_factory(path)
    params = _parameters(factory)
    kwargs = _factory_settings(path, params, {"seq_len": seq_len, "image_size": image_size, **overrides})
    if "batch_size" in params:
        if batch_size is not None:
            kwargs["batch_size"] = batch_size
        elif params["batch_size"].default is inspect.Parameter.empty:
            kwargs["batch_size"] = batch_size = _CUSTOM_BATCH_SIZE

    # A factory that builds a torchvision RegNet (its module imported torchvision's) gets the built-in names' fix.
    regnet = "torchvision.models.regnet" in sys.modules
    try:
        with _regnet_widths_on_cpu() if regnet else contextlib.nullcontext():
            result = factory(**kwargs)
    except Exception as exc:
        raise AutotuneError(
            f"the factory {path} raised {type(exc).__name__}: {one_line(exc)} "
            f"(called with {kwargs or 'no arguments'}); fix the factory or the settings passed to it"
        ) from exc
    module, batch, loss_fn = _unpack_factory_result(path, result)

    def moved(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)

    batch = {k: moved(t) for k, t in batch.items()} if isinstance(batch, Mapping) else tuple(map(moved, batch))
    first = batch_tensors(batch)[0]
    found = first.shape[0] if first.dim() > 0 else None
    if batch_size is None:
        if found is None:
            raise AutotuneError(
                f"cannot tell the batch size of {path}'s batch: its first tensor is 0-dimensional; pass "
                "batch_size, or put a tensor whose first dimension is the batch first"
            )
        batch_size = found
    elif "batch_size" not in params and found is not None and found != batch_size:
        raise AutotuneError(
            f"batch_size={batch_size} requested, but the factory {path} takes no batch_size parameter and "
            f"returned a batch of {found}: give the factory a batch_size parameter, or request "
            f"batch_size={found} (or none)"
        )
    elif found is not None and found != batch_size:  # a sequence-first batch can be right; samples/s count batch_size
        warnings.warn(
            f"autotune: the factory {path} was given batch_size={batch_size} and returned a batch whose first "
            f"tensor has {found} rows; samples/s count {batch_size} a step: if the first dimension is the batch, "
            "the factory does not use its batch_size parameter",
            stacklevel=2,
        )
    return ModelEntry(path, "custom", module, batch, loss_fn, batch_size, seq_len, image_size)


def _load_factory(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    # Like `python -m` and uvicorn: the current directory is importable, so a user's project just works.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AutotuneError(
            f"cannot import module {module_name!r} for model {path!r}: {one_line(exc)}; check the name and "
            "that its package is installed or on PYTHONPATH"
        ) from exc
    except Exception as exc:  # user code at import time can raise anything
        raise AutotuneError(
            f"importing module {module_name!r} for model {path!r} raised {type(exc).__name__}: "
            f"{one_line(exc)}; fix the error in that module"
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        close = difflib.get_close_matches(attr, public, n=3, cutoff=0.6)

        # Functions first (factories usually are), then classes; the module's own before what it imported.
        def rank(n: str) -> tuple[bool, bool, str]:
            v = vars(module)[n]
            return isinstance(v, type), getattr(v, "__module__", None) != module_name, n

        own = sorted(public, key=rank)
        more = f" and {len(own) - 10} more" if len(own) > 10 else ""
        hint = f"did you mean {', '.join(close)}?" if close else f"its callables: {', '.join(own[:10])}{more}"
        raise AutotuneError(f"module {module_name!r} has no factory {attr!r} (from {path!r}): {hint}")
    if not callable(factory):
        raise AutotuneError(
            f"{path!r} is not callable but of type {type(factory).__name__}: point the path at a function "
            "that returns (module, batch)"
        )
    return factory  # type: ignore[no-any-return]


def _unpack_factory_result(path: str, result: Any) -> tuple[nn.Module, Batch, LossFn]:
    contract = "it must return (module, batch) or (module, batch, loss_fn)"
    if isinstance(result, nn.Module):
        raise AutotuneError(
            f"the factory {path} returned only a module: {contract}, because autotune cannot invent inputs "
            "for an unknown model"
        )
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        shown = f"a tuple of {len(result)}" if isinstance(result, tuple) else f"a {type(result).__name__}"
        raise AutotuneError(f"the factory {path} returned {shown}: {contract}")
    module, batch, *rest = result
    if not isinstance(module, nn.Module):
        raise AutotuneError(
            f"the factory {path} returned a {type(module).__name__} where the module goes: {contract}, "
            "module an nn.Module"
        )
    batch = (batch,) if isinstance(batch, torch.Tensor) else batch
    if isinstance(batch, Mapping):
        bad = [k for k, t in batch.items() if not isinstance(k, str) or not isinstance(t, torch.Tensor)]
        if not batch or bad:
            raise AutotuneError(
                f"the factory {path} returned a dict batch with {'no entries' if not batch else f'keys {bad}'}"
                ": a dict batch must map argument names (str) to tensors, at least one"
            )
        batch = dict(batch)
    elif not isinstance(batch, (tuple, list)) or not batch or not all(isinstance(t, torch.Tensor) for t in batch):
        raise AutotuneError(
            f"the factory {path} returned a batch of type {type(batch).__name__}: batch must be a tensor, "
            "a non-empty tuple of tensors or a dict of tensors"
        )
    loss_fn = rest[0] if rest else _default_loss
    if not callable(loss_fn):
        raise AutotuneError(
            f"the factory {path} returned a {type(loss_fn).__name__} as loss_fn: it must be a callable "
            "loss_fn(module, batch) -> scalar tensor"
        )
    return module, batch if isinstance(batch, dict) else tuple(batch), loss_fn


# ----------------------------------------------------------------------------------------------------------
# Losses: forward and loss, no backward. Logits are upcast to float32 before cross entropy, as transformers
# does, so a bf16 model's loss is not computed in bf16 (a no-op for float32 models).


def _classification_loss(module: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    images, labels = batch
    out = module(images)  # (B, num_classes)
    if isinstance(out, torch.Tensor):
        return F.cross_entropy(out.float(), labels)
    # GoogLeNet and Inception v3 return a named tuple (logits, aux logits...) in train mode.
    main, *aux = (t for t in out if t is not None)
    loss = F.cross_entropy(main.float(), labels)
    for logits in aux:
        loss = loss + _AUX_LOSS_WEIGHT * F.cross_entropy(logits.float(), labels)
    return loss


def _causal_lm_loss(module: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    input_ids, labels = batch
    logits = module(input_ids).logits  # (B, T, V)
    # Position t predicts token t+1. Shift the labels, not the logits (as transformers does), so the large
    # (B, T, V) logits are not copied; the last position has nothing to predict and is ignored.
    targets = F.pad(labels[:, 1:], (0, 1), value=_IGNORE_INDEX)  # (B, T)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=_IGNORE_INDEX)


def _masked_lm_loss(module: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    input_ids, attention_mask, labels = batch
    logits = module(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=_IGNORE_INDEX)


def _default_loss(module: nn.Module, batch: Batch) -> torch.Tensor:
    """``module(**batch).loss`` for a dict batch whose output has one (a transformers model given
    ``labels``, what the Trainer trains on); otherwise ``module(*batch)`` (its first tensor)
    ``.float().square().mean()``: a stand-in loss.

    Squared, not a plain mean, so the gradient reaching the output is a full tensor as with a real loss,
    not a broadcast scalar; the backward pass then keeps and frees what real training does.
    """
    out = module(**batch) if isinstance(batch, Mapping) else module(*batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    first = _first_tensor(out)
    if first is None or not first.is_floating_point():
        raise AutotuneError(
            f"the default loss needs a floating-point tensor output, but the module returned "
            f"{type(out).__name__}: return (module, batch, loss_fn) from the factory"
        )
    return first.float().square().mean()


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


# ----------------------------------------------------------------------------------------------------------
# NOTE [ Building under FakeTensorMode ]
# The tracer builds workloads inside `FakeTensorMode(allow_non_fake_inputs=False)`: every tensor created
# is a FakeTensor with a shape and no data, so no memory is used, and a real tensor reaching an op is an
# error. Four things make that work here:
# 1. Heavy libraries are imported with the fake mode suspended, so any tensor they create at import time is
#    real and reusable by later builds, not tied to one tracer's mode.
# 2. `nn.init.trunc_normal_` (torch 2.14) resamples until `mask.any()` is False: a data-dependent branch a
#    FakeTensor cannot answer. A FakeTensor has no values to sample, so it is returned as is, exactly as
#    torch already does for meta tensors. (ViT, Swin, ConvNeXt, MaxViT, GoogLeNet, Inception v3.)
# 3. RegNet computes its stage widths with tensors and `.tolist()`: that arithmetic on constants runs with
#    the fake mode suspended, on the CPU (also in a factory that builds one, once torchvision's RegNet module
#    is loaded when the factory is called).
# Both patches are in place only while a fake mode is active and only for the duration of the build (they
# are process-wide meanwhile: do not build models from several threads at once).
# 4. A module is never converted (`Module.to`) under the mode: torch 2.14 cannot swap FakeTensor parameters
#    ("Cannot swap t1 because it has weakref associated with it"). Parameters are created on the right
#    device in the right dtype instead (`torch.device(...)` and the default dtype during the build).


@contextlib.contextmanager
def _fake_mode_fixes(family: str) -> Iterator[None]:
    if detect_fake_mode() is None:
        yield
        return
    original_trunc_normal = torch.nn.init.trunc_normal_

    def trunc_normal_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor if isinstance(tensor, FakeTensor) else original_trunc_normal(tensor, *args, **kwargs)

    with contextlib.ExitStack() as restore:
        torch.nn.init.trunc_normal_ = trunc_normal_  # type: ignore[assignment]
        restore.callback(setattr, torch.nn.init, "trunc_normal_", original_trunc_normal)
        # copy.deepcopy of a fake module (nn.TransformerEncoder copies its layer) reads data pointers, and
        # PyTorch warns that this "is almost definitely a bug in your code": ours to build it so, not the user's.
        restore.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor is deprecated")
        if family == "torchvision":
            restore.enter_context(_regnet_widths_on_cpu())
        yield


@contextlib.contextmanager
def _regnet_widths_on_cpu() -> Iterator[None]:
    """Rule 3 of the NOTE above: RegNet's stage widths computed with the fake mode suspended."""
    if detect_fake_mode() is None:
        yield
        return
    block_params = _import("torchvision.models.regnet").BlockParams
    original = block_params.__dict__["from_init_params"]  # the classmethod object itself

    def from_init_params(cls: type, *args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily(), torch.device("cpu"):
            return original.__func__(cls, *args, **kwargs)

    block_params.from_init_params = classmethod(from_init_params)
    try:
        yield
    finally:
        block_params.from_init_params = original


def _import(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with any fake mode suspended (rule 1 of the NOTE above)."""
    with unset_fake_temporarily():
        return importlib.import_module(name)


# ----------------------------------------------------------------------------------------------------------
# Helpers


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's RNGs for the block and restore the caller's state afterwards."""
    cuda = device.type == "cuda" and torch.cuda.is_available()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make ``dtype`` torch's default dtype for the block, so parameters are created in it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _move_module(entry: ModelEntry, device: torch.device, dtype: torch.dtype) -> None:
    """Move parameters and buffers that a builder did not create on ``device`` in ``dtype``.

    Built-in models never need it (see build_model); a factory may hard-code a device or dtype. Under
    FakeTensorMode torch 2.14 cannot convert a module (``Module.to`` fails to swap FakeTensor parameters),
    so the factory must create its tensors with the defaults.
    """

    def in_place(t: torch.Tensor) -> bool:
        # torch.device("cuda") creates tensors on "cuda:0": a device without index matches any index.
        on_device = t.device.type == device.type and device.index in (None, t.device.index)
        return on_device and (t.dtype == dtype or not t.is_floating_point())

    if all(in_place(t) for t in [*entry.module.parameters(), *entry.module.buffers()]):
        return
    try:
        entry.module.to(device=device, dtype=dtype)
    except RuntimeError as exc:
        if detect_fake_mode() is None:
            raise
        raise AutotuneError(
            f"the module of {entry.name} has tensors off device={device} or dtype={dtype}, and torch cannot "
            "convert a module under FakeTensorMode: create its parameters without an explicit device or dtype"
        ) from exc


def _parse_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise AutotuneError(f"device={device!r} is not a torch device: pass e.g. 'cpu', 'cuda' or 'cuda:1'") from exc
    fake = detect_fake_mode() is not None  # fake tensors need no real device
    if dev.type == "cuda" and not fake and not torch.cuda.is_available():
        raise AutotuneError(f"device={device!r} requested but torch sees no CUDA device here: pass device='cpu'")
    return dev


def _check_positive(what: str, value: int | None, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AutotuneError(f"{what}={value!r} is not a positive integer: pass e.g. {what}=8")


def _check_seq_len(name: str, seq_len: int | None, max_positions: int, field: str) -> int:
    if seq_len is None:
        return max_positions
    if seq_len > max_positions:
        raise AutotuneError(
            f"seq_len={seq_len} exceeds {name}'s {max_positions} positions: pass seq_len <= {max_positions}, "
            f"or raise {field} (build_model's config_overrides; from the command line, a factory of your own: "
            "--model package.module:factory)"
        )
    return seq_len


def _make_config(config_cls: Any, name: str, fields: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """``config_cls(**fields, **overrides)``, rejecting override keys the config does not know.

    transformers configs accept any keyword silently, so a typo (``n_layers``) would build the full-size
    model without a word; check against the attributes of a default config instead.
    """
    known = config_cls()
    unknown = [k for k in overrides if k != "attn_implementation" and not hasattr(known, k)]
    if unknown:
        fields_known = sorted(known.to_dict())
        close = difflib.get_close_matches(unknown[0], fields_known, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else f"known fields: {', '.join(fields_known)}"
        raise AutotuneError(
            f"config_overrides key {unknown[0]!r} is not a {config_cls.__name__} field for {name}: {hint}"
        )
    return config_cls(**{**fields, **overrides})


def _call_builder(
    builder: Callable[[], nn.Module], what: str, image_size: int | None, overrides: dict[str, Any]
) -> nn.Module:
    """Run a library builder; with user-given settings, report its failure as theirs."""
    if image_size is None and not overrides:
        return builder()  # a failure now is a bug here, not the user's: let it propagate
    try:
        return builder()
    except Exception as exc:
        settings = [f"image_size={image_size}"] if image_size is not None else []
        settings += [f"config_overrides={overrides}"] if overrides else []
        given = " and ".join(settings)
        raise AutotuneError(
            f"{what} rejected {given}: {type(exc).__name__}: {one_line(exc)}; change or remove that setting"
        ) from exc
