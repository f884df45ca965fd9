"""Model factories for tests/test_models.py, one per return form of the ``package.module:factory`` contract.

Referenced by path, e.g. ``build_model("tests.fixtures_models:make_pair", batch_size=4)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

IN_FEATURES = 8
OUT_FEATURES = 4
FIXED_BATCH_SIZE = 3
NOT_A_FACTORY = 42


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.ReLU(), nn.Linear(16, OUT_FEATURES))


def make_pair(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    """(module, batch) with the batch a single tensor."""
    return _mlp(), torch.randn(batch_size, IN_FEATURES)


def make_pair_tuple(batch_size: int = 5) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """(module, batch) with the batch a tuple; batch_size has a default."""
    return _mlp(), (torch.randn(batch_size, IN_FEATURES),)


def cross_entropy_loss(module: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(module(x), y)


def make_triple(batch_size: int) -> tuple[nn.Module, tuple[torch.Tensor, ...], object]:
    """(module, (inputs, targets), loss_fn)."""
    x = torch.randn(batch_size, IN_FEATURES)
    y = torch.randint(0, OUT_FEATURES, (batch_size,))
    return _mlp(), (x, y), cross_entropy_loss


class _Keywords(nn.Module):
    """An MLP called with keyword arguments, as the Trainer calls a model: ``module(x=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)  # type: ignore[no-any-return]


def make_dict(batch_size: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """(module, batch) with the batch a dict of keyword arguments; the output has no ``loss``."""
    return _Keywords(), {"x": torch.randn(batch_size, IN_FEATURES)}


def make_bad_dict() -> tuple[nn.Module, dict[str, object]]:
    return _Keywords(), {"x": torch.randn(2, IN_FEATURES), "mask": [1, 1]}


def make_fixed() -> tuple[nn.Module, torch.Tensor]:
    """No batch_size parameter: the factory decides the batch size."""
    return _mlp(), torch.randn(FIXED_BATCH_SIZE, IN_FEATURES)


def make_sequence(batch_size: int, seq_len: int = 16) -> tuple[nn.Module, torch.Tensor]:
    """Takes seq_len too: a (B, T, C) batch."""
    return _mlp(), torch.randn(batch_size, seq_len, IN_FEATURES)


def make_wide(batch_size: int, hidden: int = 16) -> tuple[nn.Module, torch.Tensor]:
    """Takes a keyword that config_overrides can set."""
    module = nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, OUT_FEATURES))
    return module, torch.randn(batch_size, IN_FEATURES)


def make_module_only() -> nn.Module:
    return _mlp()


def make_string() -> str:
    return "not a model"


def make_bad_batch() -> tuple[nn.Module, list[object]]:
    return _mlp(), [1, 2, 3]


def make_raises() -> tuple[nn.Module, torch.Tensor]:
    raise ValueError("no data for this model")


class ResidualMLP(nn.Module):
    """``x + fc2(tanh(fc1(x)))``: a block the policies recompute as a region."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def make_mismatched(batch_size: int = 2) -> tuple[nn.Module, torch.Tensor]:
    """A model whose forward raises: its second layer takes one feature fewer than the first gives."""
    return nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.Linear(15, 2)), torch.randn(batch_size, IN_FEATURES)


def make_siamese(batch_size: int = 4, pseudo_labels: bool = False) -> tuple[nn.Module, tuple, object]:
    """A contrastive loss (SimCLR's form): one encoder, called on two views before backward; with
    ``pseudo_labels`` a third call under ``torch.no_grad`` first (FixMatch's form), whose output only weighs
    the loss."""
    torch.manual_seed(0)
    encoder = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 8),
    )  # fmt: skip
    views = (torch.randn(batch_size, 3, 8, 8), torch.randn(batch_size, 3, 8, 8))

    def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
        a, b = batch
        weight = 1.0
        if pseudo_labels:
            with torch.no_grad():
                weight = model(a).softmax(dim=1).amax(dim=1).mean()
        za = nn.functional.normalize(model(a), dim=1)
        zb = nn.functional.normalize(model(b), dim=1)
        logits = za @ zb.t() / 0.1
        return weight * nn.functional.cross_entropy(logits, torch.arange(a.shape[0]))

    return encoder, views, loss_fn


def make_channels_last(batch_size: int = 2) -> tuple[nn.Module, tuple]:
    """A CNN moved to channels_last in its factory, as users do for speed on GPUs (fake tensors cannot build
    it: "_apply(): Couldn't swap Conv2d.weight")."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)
    )
    model = model.to(memory_format=torch.channels_last)
    return model, (torch.randn(batch_size, 3, 8, 8).to(memory_format=torch.channels_last),)


def make_transformer_encoder(batch_size: int = 2) -> tuple[nn.Module, tuple]:
    """nn.TransformerEncoder, which deep-copies its layer while it is built."""
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), (torch.randn(batch_size, 5, 16),)


def make_integer_output() -> tuple[nn.Module, torch.Tensor]:
    """A module whose output is not floating point: the default loss cannot use it."""
    return _ArgMax(), torch.randn(2, IN_FEATURES)


class _ArgMax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(IN_FEATURES, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).argmax(dim=-1)


def make_item_in_init(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    """A model whose constructor turns a tensor into a Python number (timm's drop-path rates so): it builds
    in real mode, not under FakeTensorMode, whose tensors have no values."""
    rates = [x.item() for x in torch.linspace(0, 0.1, 2)]
    model = nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.Dropout(rates[1]), nn.Linear(16, OUT_FEATURES))
    return model, torch.randn(batch_size, IN_FEATURES)


def make_ignoring_batch_size(batch_size: int = 8) -> tuple[nn.Module, torch.Tensor]:
    """A factory that takes ``batch_size`` and builds a batch of 4 whatever it is given."""
    return nn.Sequential(nn.Linear(IN_FEATURES, OUT_FEATURES)), torch.randn(4, IN_FEATURES)


def make_per_sample_loss(batch_size: int) -> tuple[nn.Module, Any, Any]:
    """A loss left per sample (``reduction="none"``): backward needs a scalar."""
    model = nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.ReLU(), nn.Linear(16, OUT_FEATURES))
    batch = (torch.randn(batch_size, IN_FEATURES), torch.randint(0, OUT_FEATURES, (batch_size,)))
    return model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")


def make_detached_loss(batch_size: int) -> tuple[nn.Module, Any, Any]:
    """A loss cut from its graph (``.detach()``): nothing to differentiate."""
    model = nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.ReLU(), nn.Linear(16, OUT_FEATURES))
    batch = (torch.randn(batch_size, IN_FEATURES), torch.randint(0, OUT_FEATURES, (batch_size,)))
    return model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]).detach()


class _GroupedExperts(nn.Module):
    """Two experts' weights applied to the rows routed to each through ``torch._grouped_mm`` in fp32, as
    transformers' Mixtral experts do: the CPU's kernel takes fp32, the fake (meta) kernel only bf16/fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, IN_FEATURES, OUT_FEATURES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32)
        return torch._grouped_mm(x, self.weight, offs=offsets)


def make_grouped_mm(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    """A model with an op whose fake kernel refuses what its real one takes."""
    return _GroupedExperts(), torch.randn(batch_size, IN_FEATURES)


class _WhereBlock(nn.Module):
    """A residual conv block ending in a leaky ``torch.where``: its mask and its sum are saved apart."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x + self.c2(torch.relu(self.c1(x)))
        return torch.where(z > 0, z, 0.1 * z)


class WhereMaskNet(nn.Module):
    """Three ``_WhereBlock`` and a head that clones the pooled features and masks them in place: the mask
    read the clone before ``masked_fill_`` wrote it, so replaying the mask re-makes the clone as it was."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(_WhereBlock(c), _WhereBlock(c), _WhereBlock(c))
        self.fc = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.blocks(self.stem(x)).mean((2, 3)).clone()
        z.masked_fill_(z.abs() > 0.05, 0.0)
        return self.fc(z)


class _SquareKeepingInput(torch.autograd.Function):
    """``x * x`` whose backward reads ``x`` from a ``ctx`` attribute, not from ``save_for_backward``: autograd
    does not see it saved, yet it holds it until backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.x = x
        return x * x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return 2 * ctx.x * g


class CtxHeldMLP(nn.Module):
    """Linear, tanh and ``_SquareKeepingInput``, four times: each tanh output is saved by tanh and held by the
    square's ``ctx`` too."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = _SquareKeepingInput.apply(torch.tanh(layer(x)))
        return self.head(x)


class GeluMLP(nn.Module):
    """Linear, GPT-2's tanh GELU written out (eight elementwise ops, each saving), Linear: backward nodes that
    unpack two saved tensors and run two ops (a product's gradient)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(0.5 * h * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * torch.pow(h, 3.0)))))


class FreedBeforeReplay(nn.Module):
    """Saved tensors that backward frees before a later replay reads them: ``z`` (kept, as the view ``a`` that
    ``a * a`` saves, whose backward runs first), read by the chain that ``relu(y[:, :8])`` replays; ``p``, saved
    by ``p.pow(2)`` (backward first) and read by ``tanh(p)``, which saves only its output; BatchNorm's input
    and its saved mean, read again by the mean's replay."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.lin, self.proj = nn.Linear(16, d), nn.Linear(16, d)
        self.conv, self.bn = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc = nn.Linear(16 + d + 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x)
        a = z[:, 8:16]
        y = (z * 2.0 + 1.0) * 3.0 - 1.0  # saved by nobody: a replay of the relu re-makes the chain from z
        p = self.proj(x)
        q = torch.tanh(p) + p.pow(2)
        c = torch.relu(self.bn(self.conv(x.view(-1, 1, 4, 4)))).mean((2, 3))
        return self.fc(torch.cat([torch.relu(y[:, :8]), a * a, q, c], 1))


class ProductOfChains(nn.Module):
    """``u * v`` where ``v`` is made from ``u``: the product's backward node unpacks ``v`` (its second factor)
    first, so where both are recomputed, ``u``'s replay runs nested inside ``v``'s and its temporaries are held
    until ``v``'s ends; ``v * u`` unpacks ``u`` first and the two replays run one after the other."""

    def __init__(self, d: int = 64, swapped: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(16, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, 10)
        self.swapped = swapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.tanh(self.b(torch.relu(self.a(x))))
        v = torch.tanh(self.d(torch.relu(self.c(u))))
        return self.head(v * u if self.swapped else u * v)


class MaskedSum(nn.Module):
    """``s[s > 0.1]``: the boolean mask that indexing saves is made from ``s``, which ``tanh`` saves too. A
    replay of the mask from a rounded (compressed) ``s`` selects another number of elements."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.tanh(self.fc2(self.fc1(x)))
        return self.head(s) + s[s > 0.1].sum()


class ProductOfStack(nn.Module):
    """``stack([u, 2u]).prod(0)``: PyTorch's ``prod`` backward takes another path (exact zeros handled, other
    rounding) while any dispatch mode is on the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(16, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.tanh(self.a(x))
        return self.head(torch.stack([u, u * 2], 0).prod(0))


class StackedWhere(nn.Module):
    """``p = st[0] * st[1]`` on ``st = stack([u, where(mask, v * u, sigmoid(v))])``, concatenated with ``u * z``
    into the head's input: the multiplication saves two views of the stack, and where the head's input and those
    views are recomputed, the head's replay (backward's first) re-makes ``p`` and so the stack, nested in it,
    while ``where``'s output, gone by the stack's own first use, is still live."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, d), nn.Linear(d, d), nn.Linear(d, 10)
        self.d = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.tanh(self.a(x))
        v = self.b(u)
        z = torch.where(x.repeat(1, self.d // 16) > 0.1, v * u, torch.sigmoid(v))
        st = torch.stack([u, z], 0)
        p = st[0] * st[1]
        c = torch.cat([u * z, p], 1)
        return self.head(c[:, : self.d] + c[:, self.d :])


class PooledChain(nn.Module):
    """max_pool2d's backward unpacks its input (a convolution of ``relu(c1(x) * 2 + 1)``) and its int64 indices
    at one op: where all three are recomputed, the convolution's replay (the relu's nested in it) runs first and
    drops its temporaries, then the indices' replay."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c1(x) * 2.0 + 1.0)
        return self.fc(F.max_pool2d(self.c2(h), 2).mean((2, 3)))


class TwoLayerLSTM(nn.Module):
    """The second LSTM layer's op makes its cell state and its workspace, which its backward unpacks at one op:
    recomputed, each is replayed in turn, the first replay's other outputs (the workspace among them) dropped
    before the second runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.rnn, self.head = nn.LSTM(8, 12, num_layers=2, batch_first=True), nn.Linear(12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, (_, c) = self.rnn(torch.tanh(self.inp(x)))
        return self.head(y[:, -1] * torch.sigmoid(c[-1]))


class _TiedEmbeddingBlock(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.word(ids) * 2)


class TiedEmbedding(nn.Module):
    """An embedding inside a block of its own whose weight is the output head's too (BERT's masked-LM head, GPT-2's
    LM head): the weight's two gradients are summed where the embedding's arrives."""

    def __init__(self, vocab: int = 1024, d: int = 128) -> None:
        super().__init__()
        self.emb = _TiedEmbeddingBlock(vocab, d)
        self.body = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)
        self.head.weight = self.emb.word.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(ids)))).flatten(0, 1)


class ConvBNReLU(nn.Module):
    """relu(bn(conv(x))) into a linear head: BatchNorm's replay passes copies of its running statistics."""

    def __init__(self, c: int = 64) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class ThreePoolCNN(nn.Module):
    """Three convolution, activation and max-pool stages: max_pool2d's backward unpacks its input (the
    activation's output), the largest tensor backward reads there."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = (
            nn.Conv2d(3, 8, 3, padding=1),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.Conv2d(16, 16, 3, padding=1),
        )
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        x = F.max_pool2d(torch.tanh(self.c3(x)), 2)
        return self.head(x.flatten(1))


class _Attention(nn.Module):
    """``x + o(attention(ln(x)))``: the output projection's backward node unpacks its saved input when it starts,
    before its first op (a product with the weight, which reads no saved tensor)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.h = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).chunk(3, -1)
        q, k, v = (u.view(b, t, self.h, d // self.h).transpose(1, 2) for u in (q, k, v))
        y = (torch.softmax(q @ k.transpose(-1, -2), -1) @ v).transpose(1, 2).reshape(b, t, d)
        return x + self.o(y)


class AttentionNet(nn.Module):
    """An embedding, one attention block (``att``), a mean-pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.att, self.head = nn.Linear(8, 16), _Attention(), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.att(self.emb(x)).mean(1))


class HeldReader(nn.Module):
    """A call (``a``) reads a tensor no op saves (``h``, a sum over a wide product): as a region it holds it, as an
    argument, until its backward is done. ``exp`` outside it reads ``h`` too, and its output, recomputed, is
    replayed at the product's backward, before ``a``'s: ``h`` is held there, so the replay reads it as it is
    instead of re-making it from the wide product."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(32, 16 * 128), nn.Linear(128, 10)
        self.a = nn.Sequential(nn.ReLU(), nn.Linear(128, 128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).view(-1, 16, 128).sum(1)
        return self.out(self.a(h) * torch.exp(h))


class TwoReaders(nn.Module):
    """Two calls (``a``, ``b``) that read one tensor no op saves (``h``, a sum): as regions each holds it, as
    an argument, until its backward is done; wide logits put the peak at the loss's backward, before both."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(32, 512), nn.Linear(16, 4096)
        self.a = nn.Sequential(nn.ReLU(), nn.Linear(512, 16))
        self.b = nn.Sequential(nn.Tanh(), nn.Linear(512, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + 1.0
        return self.out(self.a(h) * self.b(h))


def make_tied(batch_size: int = 2) -> tuple[nn.Module, tuple[torch.Tensor, ...], object]:
    """TiedEmbedding on 4 tokens a sample: its peak is the end of backward, where plain PyTorch holds the tied
    weight's two gradients and their sum (runtime R14 sums them in place under any policy)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (batch_size, 4), generator=g)
    return TiedEmbedding(), (ids, torch.randint(0, 1024, (batch_size * 4,), generator=g)), cross_entropy_loss
