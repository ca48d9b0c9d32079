"""PyTorch mirror of keel's GPT (docs/architecture.md "Model"), dense and MoE.

Written the way a PyTorch user would write it: nn.Module, nn.Linear, layer
norm, tanh GELU, masked causal attention and F.cross_entropy, with autograd
doing the backward pass.  Parameter names are exactly keel's (nanoGPT names,
PyTorch [out, in] shapes), so `model.named_parameters()` lines up with the
tensors keel writes out.  The same module serves the correctness oracle
(float64, tests/python/test_pytorch_oracle.py) and the throughput benchmark
(float32, bench/train_throughput.py).

Run with Debian's interpreter: /usr/bin/python3 (torch 1.13).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

LN_EPS = 1e-5


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    n_expert: int = 0
    top_k: int = 2
    moe_every: int = 1
    aux_loss_coef: float = 0.01

    @property
    def padded_vocab(self) -> int:
        return (self.vocab_size + 127) // 128 * 128

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_expert > 0 and (layer + 1) % self.moe_every == 0

    @classmethod
    def from_dict(cls, d: Mapping) -> "GPTConfig":
        """From keel's resolved config (its "model" section); unknown keys are ignored."""
        kw = {}
        for f in fields(cls):
            if f.name in d:
                kw[f.name] = float(d[f.name]) if f.type in ("float", float) else int(d[f.name])
        return cls(**kw)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_head must divide n_embd"
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        # rows of c_attn: q, then k, then v; head j owns rows j*d..(j+1)*d of each
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
        self.register_buffer("causal_mask", mask.view(1, 1, cfg.seq_len, cfg.seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H, d = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, H, d).transpose(1, 2)  # [B, H, T, d]
        k = k.view(B, T, H, d).transpose(1, 2)
        v = v.view(B, T, H, d).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        att = att.masked_fill(~self.causal_mask[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # [B, H, T, d]
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


def top_k_lowest_index(probs: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries per row; equal values go to the lower index.

    torch.topk does not promise an order among ties, a stable descending sort
    does (equal elements keep their original, ascending-index order)."""
    values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[:, :k], order[:, :k]


class MoE(nn.Module):
    """Softmax router, top-k, gates renormalised over the k chosen, dropless,
    Switch load-balancing loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert 1 <= cfg.top_k <= cfg.n_expert, "top_k must be in 1..n_expert"
        self.n_expert = cfg.n_expert
        self.top_k = cfg.top_k
        self.aux_loss_coef = cfg.aux_loss_coef
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.experts = nn.ModuleList([MLP(cfg) for _ in range(cfg.n_expert)])

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        xf = x.reshape(B * T, C)
        N, E, k = xf.shape[0], self.n_expert, self.top_k
        probs = F.softmax(self.router(xf), dim=-1)  # [N, E]
        top_p, idx = top_k_lowest_index(probs, k)  # [N, k]
        gate = top_p / top_p.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(xf)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            y = expert(xf[tok]) * gate[tok, slot].unsqueeze(-1)
            out = out.index_add(0, tok, y)
        # Switch aux loss: f_e is the share of (token, slot) assignments (no
        # gradient), P_e the mean router probability.
        with torch.no_grad():
            f = torch.bincount(idx.reshape(-1), minlength=E).to(probs.dtype) / (N * k)
        P = probs.mean(dim=0)
        aux = self.aux_loss_coef * E * (f * P).sum()
        return out.view(B, T, C), aux


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=LN_EPS)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=LN_EPS)
        self.is_moe = cfg.is_moe_layer(layer)
        if self.is_moe:
            self.moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        x = x + self.attn(self.ln_1(x))
        if self.is_moe:
            y, aux = self.moe(self.ln_2(x))
            return x + y, aux
        return x + self.mlp(self.ln_2(x)), None


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Parameter(torch.empty(cfg.padded_vocab, cfg.n_embd))  # tied LM head
        self.wpe = nn.Parameter(torch.empty(cfg.seq_len, cfg.n_embd))
        self.h = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=LN_EPS)
        self.init_weights()

    def init_weights(self, seed: Optional[int] = None) -> None:
        """docs/architecture.md "Model"'s distributions (not keel's generator: the oracle loads
        keel's own initial weights instead)."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        proj_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    std = proj_std if name.endswith("c_proj.weight") else 0.02
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * std)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """Returns (logits [B, T, Vp], mean cross-entropy or None, summed aux loss)."""
        B, T = idx.shape
        assert T <= self.cfg.seq_len, f"sequence of {T} exceeds seq_len {self.cfg.seq_len}"
        idx = idx.long()
        pos = torch.arange(T, device=idx.device)
        x = F.embedding(idx, self.wte) + F.embedding(pos, self.wpe).unsqueeze(0)
        aux = torch.zeros((), dtype=x.dtype, device=x.device)
        for block in self.h:
            x, a = block(x)
            if a is not None:
                aux = aux + a
        x = self.ln_f(x)
        logits = x @ self.wte.t()  # [B, T, Vp]
        loss = None
        if targets is not None:
            V = self.cfg.vocab_size  # padded columns never take part
            loss = F.cross_entropy(logits[..., :V].reshape(-1, V), targets.reshape(-1).long())
        return logits, loss, aux


# ----------------------------------------------------------------------------
# Loading keel's tensors


def load_numpy_params(model: GPT, arrays: Mapping[str, np.ndarray]) -> None:
    """Copies arrays (keel's names and shapes) into the model; every parameter
    must be given exactly once, with its exact shape."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(arrays))
    extra = sorted(set(arrays) - set(params))
    if missing or extra:
        raise ValueError(f"parameter names differ: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for name, p in params.items():
            a = np.asarray(arrays[name])
            if tuple(a.shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(a.shape)}, model expects {tuple(p.shape)}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(a)).to(p.dtype))


# ----------------------------------------------------------------------------
# Training


def make_optimizer(model: nn.Module, lr: float, betas: Tuple[float, float] = (0.9, 0.95),
                   eps: float = 1e-8, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on 2-D tensors only (linear weights,
    wte, wpe, router), none on biases and LayerNorm parameters."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def grad_global_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def train_step(model: GPT, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor,
               micro_batches: int = 1, grad_clip: float = 1.0, lr: Optional[float] = None
               ) -> Tuple[float, float]:
    """One optimizer step over a batch [B, T] split into `micro_batches` row
    blocks: each microbatch's (CE + aux) / M is backpropagated, gradients are
    clipped to a global norm of `grad_clip` (0 = no clip) and AdamW steps with
    `lr` (when given). Returns (mean CE over microbatches, pre-clip norm)."""
    B = inputs.shape[0]
    M = micro_batches
    if B % M != 0:
        raise ValueError(f"batch {B} is not a multiple of micro_batches {M}")
    mb = B // M
    optimizer.zero_grad(set_to_none=True)
    ce_sum = 0.0
    for m in range(M):
        x = inputs[m * mb:(m + 1) * mb]
        y = targets[m * mb:(m + 1) * mb]
        _, loss, aux = model(x, y)
        ((loss + aux) / M).backward()
        ce_sum += loss.item()
    params = list(model.parameters())
    for p in params:  # e.g. an expert no token chose: its gradient is zero, not absent
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = grad_global_norm(params)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.step()
    return ce_sum / M, float(norm)


def lr_schedule(step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The learning rate of step `step` (0-based) as docs/architecture.md "Optimizer and loop"
    documents it, written from that description and not from keel's code: linear
    warmup from lr/warmup_steps to lr, then cosine decay to lr*min_lr_ratio at
    the last step. The oracle holds keel's rates to it; the benchmark uses it."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - 1 - warmup_steps)
    t = min(1.0, max(0.0, (step - warmup_steps) / span))
    min_lr = lr * min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * t)) * (lr - min_lr)


def param_names(model: nn.Module) -> List[str]:
    return [n for n, _ in model.named_parameters()]


def read_llmc_shard(path: str) -> np.ndarray:
    """Tokens of an llm.c shard (header of 256 int32: magic 20240520, version 1, count)."""
    header = np.fromfile(path, dtype=np.int32, count=256)
    if header[0] != 20240520 or header[1] != 1:
        raise ValueError(f"{path}: not an llm.c shard (magic {header[0]}, version {header[1]})")
    return np.fromfile(path, dtype=np.uint16, offset=256 * 4, count=int(header[2]))


def write_llmc_shard(path: str, tokens: np.ndarray) -> None:
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())
