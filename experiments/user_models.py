"""Models of the kind users bring through ``--model package.module:factory``, not from the zoo: a CNN with
GroupNorm (no BatchNorm), in the style of a diffusion model's UNet blocks, and a decoder-only transformer in
the style of Llama (RMSNorm, SwiGLU, rotary positions, causal attention through SDPA).

    autotune search --model experiments.user_models:groupnorm_cnn --gpu cpu --budget 60MB --measure 3
    autotune search --model experiments.user_models:tiny_llama --gpu cpu --budget 40MB --measure 3
    autotune search --model experiments.user_models:hf_causal_lm --gpu cpu --budget 4MB

Each factory takes ``batch_size`` (and the decoders ``seq_len``) with defaults small enough for a CPU.
``groupnorm_cnn`` and ``tiny_llama`` return ``(module, (inputs, targets), loss_fn)``; ``hf_causal_lm``
returns a transformers model and a dict batch, the way the Hugging Face Trainer feeds one (``model(**batch)``,
whose ``.loss`` is the loss). Synthetic batches, seeded; nothing is downloaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# -- a CNN with GroupNorm -------------------------------------------------------------------------------------
class _ResBlock(nn.Module):
    """GroupNorm, SiLU, 3x3 convolution, twice, and a skip (a UNet's ResBlock without its time embedding)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(8, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class GroupNormCNN(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (32, 64, 64, 128), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, widths[0], 3, padding=1)
        blocks: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths, widths[1:] + widths[-1:], strict=True)):
            blocks.append(_ResBlock(a, b))
            if i < len(widths) - 1:
                blocks.append(nn.AvgPool2d(2))  # downsample between stages, as an encoder does
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


def _cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def groupnorm_cnn(batch_size: int = 8, image_size: int = 64) -> tuple[nn.Module, tuple[torch.Tensor, ...], object]:
    """A 4-stage residual CNN with GroupNorm and SiLU, 10 classes, on ``image_size`` px images."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=g, device="cpu")
    y = torch.randint(0, 10, (batch_size,), generator=g, device="cpu")
    return GroupNormCNN(), (x.to(torch.get_default_device()), y.to(torch.get_default_device())), _cross_entropy


# -- a Llama-style decoder -----------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (B, nh, T, hs): pairs (x1, x2) turned by the position's angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_head)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, 4 * dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, n_layer: int = 4, n_head: int = 4, max_len: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_head) for _ in range(n_layer))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        hs = dim // n_head
        inv = 1.0 / (10000 ** (torch.arange(0, hs, 2).float() / hs))
        angles = torch.outer(torch.arange(max_len).float(), inv)  # (T, hs / 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def tiny_llama(batch_size: int = 4, seq_len: int = 128) -> tuple[nn.Module, tuple[torch.Tensor, ...], object]:
    """A 4-layer Llama-style decoder (dim 128, vocabulary 512), next-token loss on random tokens."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (batch_size, seq_len + 1), generator=g, device="cpu").to(torch.get_default_device())
    return TinyLlama(max_len=max(256, seq_len)), (tokens[:, :-1], tokens[:, 1:]), _cross_entropy


# -- a transformers model, Trainer style ---------------------------------------------------------------------
def hf_causal_lm(batch_size: int = 4, seq_len: int = 32) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A 2-layer GPT-2 (n_embd 64, 2 heads, vocabulary 128) from a config, with a dict batch ``input_ids`` and
    ``labels`` (B, T): no loss_fn, so the loss is ``model(**batch).loss``, what the Trainer optimises."""
    from transformers import GPT2Config, GPT2LMHeadModel

    # No key/value cache, as the Trainer sets it for training (TrainingArguments.use_cache is False): a cache
    # changes which tensors attention saves, so the trace and the training run must agree on it.
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=max(64, seq_len), bos_token_id=0, eos_token_id=0,
        use_cache=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=g, device="cpu")
    tokens = tokens.to(torch.get_default_device())
    # The model shifts the labels itself (position t predicts token t + 1).
    return GPT2LMHeadModel(config), {"input_ids": tokens, "labels": tokens.clone()}
