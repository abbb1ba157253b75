"""Models a user writes without trainwise (tests' factories, importable as
`own_models:NAME`): a Llama in the manner of Meta's reference code (its own attention with
wq/wk/wv/wo, its feed-forward w1/w2/w3, RMSNorm, rotary) and a GPT-2 in the manner of
nanoGPT (one fused c_attn projection, GELU MLP, learned positions, the head tied to the
token embedding), each sized like one of trainwise's presets; a model with no repeated
blocks; and factories that fail."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions on x[B, H, T, D] (the half-split layout)."""
    t, d = x.shape[-2], x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angle = torch.outer(torch.arange(t, dtype=torch.float32, device=x.device), freq)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, theta: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.theta = n_heads, n_kv_heads, theta
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, self.theta), rotate(k, self.theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, theta: float):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = LlamaAttention(dim, n_heads, n_kv_heads, theta)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                 hidden: int, tied: bool, theta: float = 10000.0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            TransformerBlock(dim, n_heads, n_kv_heads, hidden, theta) for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def llama_7b() -> Llama:
    """Llama-2-7B's shape (trainwise's llama-7b)."""
    return Llama(32000, 4096, 32, 32, 32, 11008, tied=False)


def llama_small() -> Llama:
    """trainwise's `small` preset's shape: 6 layers of 256, GQA 8/4, tied."""
    return Llama(256, 256, 6, 8, 4, 1024, tied=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, n_embd),
                "wpe": nn.Embedding(block_size, n_embd),
                "h": nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
                "ln_f": nn.LayerNorm(n_embd),
            }
        )
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt2_124m(block_size: int = 1024) -> GPT2:
    """GPT-2 small's shape (trainwise's gpt2-124m) with `block_size` positions."""
    return GPT2(50257, block_size, 12, 12, 768)


class Wide(nn.Module):
    """No repeated blocks: three layers of different widths."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 96), nn.Linear(96, 48), nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


def wide() -> Wide:
    return Wide()


def raises():
    raise RuntimeError("checkpoint file missing")


def not_a_module():
    return {"weights": 1}
