"""PyTorch reference of the Llama 3 family (Llama 3 / 3.1 / 3.2 text models).

An independent float64 oracle for keel's own Llama implementation, written
from the published definition and not from keel's code: Hugging Face
transformers' LlamaForCausalLM conventions (parameter names, [out, in]
shapes, rotate-half rotary, grouped-query attention by repeating k/v heads,
RMSNorm, SwiGLU MLP) and Meta's llama3 reference code for the Llama 3.1
rope scaling.  Parameter names are exactly Hugging Face's, so
`model.named_parameters()` lines up with a converted HF checkpoint
(safetensors) and with what keel is meant to write out.

Sources followed (formulas re-derived and written here, not copied):
  * huggingface/transformers src/transformers/models/llama/modeling_llama.py:
    LlamaRMSNorm, rotate_half, apply_rotary_pos_emb, repeat_kv, LlamaMLP,
    LlamaAttention (eager path), LlamaDecoderLayer, LlamaModel,
    LlamaForCausalLM.
  * huggingface/transformers src/transformers/modeling_rope_utils.py:
    _compute_default_rope_parameters and _compute_llama3_parameters.
  * meta-llama/llama-models models/llama3/reference_impl/model.py:
    apply_scaling, precompute_freqs_cis, apply_rotary_emb (the complex,
    interleaved-pair convention of Meta's checkpoints), repeat_kv.
  * huggingface/transformers src/transformers/models/llama/
    convert_llama_weights_to_hf.py: permute (Meta's wq/wk rows -> HF's).

Everything is plain PyTorch with autograd doing the backward pass.  Angles
are computed in float64 whatever the model dtype (HF computes them in
float32); see inv_frequencies.

Run with Debian's interpreter: /usr/bin/python3 (torch 1.13).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Dict, Mapping, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_gpt


@dataclass
class RopeScaling:
    """Llama 3.1's frequency-dependent rope scaling (HF rope_type "llama3").

    Defaults are the published Llama 3.1 values (Meta's apply_scaling
    constants, also in the released config.json files)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_dict(cls, d: Mapping) -> "RopeScaling":
        """From an HF-style rope_scaling dict; only rope_type "llama3" (or no type) is accepted."""
        kind = d.get("rope_type", d.get("type", "llama3"))
        if kind != "llama3":
            raise ValueError(f"rope_scaling type {kind!r} is not Llama 3.1's 'llama3'")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        missing = known - set(kw)
        if missing:
            raise ValueError(f"rope_scaling lacks {sorted(missing)}")
        return cls(factor=float(kw["factor"]), low_freq_factor=float(kw["low_freq_factor"]),
                   high_freq_factor=float(kw["high_freq_factor"]),
                   original_max_position_embeddings=int(kw["original_max_position_embeddings"]))


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    seq_len: int = 256            # HF max_position_embeddings: the largest global position + 1
    n_layer: int = 4              # num_hidden_layers
    n_head: int = 4               # num_attention_heads
    n_kv_head: int = 4            # num_key_value_heads (grouped-query attention when < n_head)
    n_embd: int = 256             # hidden_size
    ffn_hidden: int = 688         # intermediate_size
    rope_theta: float = 500000.0  # Llama 3's base (Llama 2 used 10000)
    rope_scaling: Optional[Union[RopeScaling, Mapping]] = None  # None: plain RoPE (Llama 3.0)
    norm_eps: float = 1e-5        # rms_norm_eps of the Llama 3 releases
    tie_embeddings: bool = False  # tie_word_embeddings (True for Llama 3.2 1B/3B)

    def __post_init__(self):
        if isinstance(self.rope_scaling, Mapping):
            self.rope_scaling = RopeScaling.from_dict(self.rope_scaling)
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_head {self.n_head} must divide n_embd {self.n_embd}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary pairs")
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_kv_head {self.n_kv_head} must divide n_head {self.n_head}")
        rs = self.rope_scaling
        if rs is not None and not rs.high_freq_factor > rs.low_freq_factor:
            # HF only warns; equal factors divide by zero in the smooth band.
            raise ValueError("rope_scaling needs high_freq_factor > low_freq_factor")

    @property
    def head_dim(self) -> int:
        # Llama 3's head_dim is always hidden_size / num_attention_heads (no separate head_dim field).
        return self.n_embd // self.n_head

    @property
    def n_rep(self) -> int:
        return self.n_head // self.n_kv_head

    @classmethod
    def from_hf(cls, d: Mapping) -> "LlamaConfig":
        """From an HF LlamaConfig dict (config.json)."""
        rs = d.get("rope_scaling")
        return cls(vocab_size=int(d["vocab_size"]), seq_len=int(d["max_position_embeddings"]),
                   n_layer=int(d["num_hidden_layers"]), n_head=int(d["num_attention_heads"]),
                   n_kv_head=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
                   n_embd=int(d["hidden_size"]), ffn_hidden=int(d["intermediate_size"]),
                   rope_theta=float(d.get("rope_theta", 10000.0)),
                   rope_scaling=RopeScaling.from_dict(rs) if rs else None,
                   norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                   tie_embeddings=bool(d.get("tie_word_embeddings", False)))


# ----------------------------------------------------------------------------
# Rotary position embedding


def inv_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim / 2], float64, scaled when
    cfg.rope_scaling is set.

    Unscaled: theta^(-2i/d), i = 0..d/2-1 (modeling_rope_utils.py
    _compute_default_rope_parameters; Meta's precompute_freqs_cis).  HF and
    Meta evaluate this in float32; here it is float64, so at long positions
    an implementation that follows HF's float32 will differ by about
    position * 6e-8 radians.

    Llama 3.1 scaling (modeling_rope_utils.py _compute_llama3_parameters,
    Meta's apply_scaling), by wavelength 2*pi/f against the original context
    L = original_max_position_embeddings:
      wavelength < L / high_freq_factor  -> f unchanged (fast rotations);
      wavelength > L / low_freq_factor   -> f / factor;
      otherwise, with s = (L / wavelength - low) / (high - low):
                                            (1 - s) * f / factor + s * f.
    Both boundaries belong to the smooth band (HF's ~(<) & ~(>), Meta's
    >= / <=); s is 0 and 1 there, so the bands join continuously."""
    d = cfg.head_dim
    i2 = torch.arange(0, d, 2, dtype=torch.float64)
    inv = 1.0 / (float(cfg.rope_theta) ** (i2 / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    L = float(rs.original_max_position_embeddings)
    low_wavelen = L / rs.low_freq_factor
    high_wavelen = L / rs.high_freq_factor
    wavelen = 2.0 * math.pi / inv
    smooth = (L / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1.0 - smooth) * inv / rs.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, out)


def rotary_cos_sin(cfg: LlamaConfig, T: int, position_offset: int = 0,
                   dtype: torch.dtype = torch.float64, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for global positions position_offset .. position_offset+T-1.

    The angle table is duplicated along the last dimension (cat(freqs, freqs)),
    HF's layout, so that column j and column j + d/2 rotate together
    (modeling_llama.py LlamaRotaryEmbedding.forward).  Positions are global:
    a later chunk, or a context-parallel shard, passes its first position."""
    inv = inv_frequencies(cfg)
    pos = torch.arange(position_offset, position_offset + T, dtype=torch.float64)
    ang = torch.outer(pos, inv)
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension (modeling_llama.py rotate_half)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, d] rotated: x*cos + rotate_half(x)*sin (modeling_llama.py apply_rotary_pos_emb).

    Pairs are (j, j + d/2), not Meta's interleaved (2j, 2j+1): HF's q/k
    weights are Meta's with rows permuted (meta_to_hf_qk), which makes the
    two conventions give the same attention scores."""
    return x * cos + rotate_half(x) * sin


def meta_to_hf_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's wq / wk [n_heads*d, C] -> HF's q_proj / k_proj rows.

    convert_llama_weights_to_hf.py permute: within each head, HF row
    i*(d/2) + j is Meta row 2j + i (i in {0, 1}), i.e. the real parts of
    Meta's complex pairs go to the first half, the imaginary parts to the
    second half."""
    rows, cols = w.shape
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_to_meta_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of meta_to_hf_qk."""
    rows, cols = w.shape
    d = rows // n_heads
    return w.reshape(n_heads, 2, d // 2, cols).transpose(1, 2).reshape(rows, cols)


# ----------------------------------------------------------------------------
# Modules


class LlamaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps), then times the weight (modeling_llama.py LlamaRMSNorm).

    HF normalises in float32 and multiplies by the weight after casting back
    to the input dtype.  Here the normalisation runs in float32 or wider:
    HF's .to(float32) would also narrow a float64 input, which an oracle must
    not do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        h = x.to(torch.promote_types(in_dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(in_dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, T, d] -> [B, Hkv*n_rep, T, d]; query head j reads kv head j // n_rep
    (modeling_llama.py repeat_kv, i.e. repeat_interleave on the head axis)."""
    if n_rep == 1:
        return x
    B, Hkv, T, d = x.shape
    return x[:, :, None].expand(B, Hkv, n_rep, T, d).reshape(B, Hkv * n_rep, T, d)


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary q/k, no biases
    (modeling_llama.py LlamaAttention, eager path)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        C, d = cfg.n_embd, cfg.head_dim
        # registration order is HF's, so named_parameters() lists them in its order
        self.q_proj = nn.Linear(C, cfg.n_head * d, bias=False)
        self.k_proj = nn.Linear(C, cfg.n_kv_head * d, bias=False)
        self.v_proj = nn.Linear(C, cfg.n_kv_head * d, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * d, C, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, d], k and v [B, Hkv, T, d]; q and k rotated by cos/sin
        (their positions).  v is never rotated."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q_offset: int = 0, k_offset: int = 0) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), causal) v, then o_proj.

        The causal mask is by global position: query q_offset+i sees key
        k_offset+j iff k_offset+j <= q_offset+i.  So a chunk's queries can be
        run against the keys of everything up to it (what a context-parallel
        shard does); every query must see at least one key."""
        B, H, Tq, d = q.shape
        Tk = k.shape[2]
        n_rep = self.n_head // self.n_kv_head
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        qpos = torch.arange(Tq, device=q.device) + q_offset
        kpos = torch.arange(Tk, device=q.device) + k_offset
        allowed = kpos.view(1, Tk) <= qpos.view(Tq, 1)
        att = att.masked_fill(~allowed, float("-inf"))
        # HF upcasts the softmax to float32; never narrow a float64 run
        att = F.softmax(att, dim=-1, dtype=torch.promote_types(att.dtype, torch.float32)).to(q.dtype)
        y = (att @ v).transpose(1, 2).reshape(B, Tq, H * d)
        return self.o_proj(y)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.attend(q, k, v)


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) (modeling_llama.py LlamaMLP with hidden_act "silu";
    Meta's FeedForward w2(silu(w1 x) * w3 x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm1 x); out = h + mlp(norm2 h) (modeling_llama.py LlamaDecoderLayer)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg.n_embd, cfg.norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.n_embd, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """The "model." prefix of HF's names: embeddings, layers, final norm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg) for _ in range(cfg.n_layer)])
        self.norm = LlamaRMSNorm(cfg.n_embd, cfg.norm_eps)


class Llama(nn.Module):
    """LlamaForCausalLM: parameters named model.* and lm_head.weight (absent when tied)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.init_weights()

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_embeddings else self.lm_head.weight

    def init_weights(self, seed: Optional[int] = None) -> None:
        """HF LlamaPreTrainedModel._init_weights' distributions: N(0, 0.02)
        (initializer_range) for every linear and embedding weight, ones for
        the norms.  Not keel's generator: an oracle loads keel's own weights."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.02)

    def hidden_states(self, idx: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
        """The final-norm output [B, T, C]."""
        B, T = idx.shape
        if position_offset < 0 or position_offset + T > self.cfg.seq_len:
            raise ValueError(f"positions {position_offset}..{position_offset + T - 1} "
                             f"outside 0..{self.cfg.seq_len - 1}")
        x = self.model.embed_tokens(idx.long())
        # one cos/sin table for all layers, as HF's LlamaModel passes position_embeddings down
        cos, sin = rotary_cos_sin(self.cfg, T, position_offset, dtype=x.dtype, device=x.device)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, position_offset: int = 0
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns (logits [B, T, vocab], mean cross-entropy or None).

        targets are already aligned with idx (the next tokens): unlike HF's
        LlamaForCausalLM(labels=...), nothing is shifted here.  Targets of
        -100 are ignored, HF's ignore_index.  position_offset is the global
        position of idx[:, 0]; attention still only sees this chunk's keys
        (use LlamaAttention.attend for a chunk against earlier keys)."""
        x = self.hidden_states(idx, position_offset)
        logits = F.linear(x, self.head_weight())
        loss = None
        if targets is not None:
            V = self.cfg.vocab_size
            loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1).long(), ignore_index=-100)
        return logits, loss


# ----------------------------------------------------------------------------
# State dicts (HF names, [out, in] shapes)


# Every parameter given once with its exact shape, as for the GPT reference;
# a tied model takes no lm_head.weight (HF checkpoints of tied models may
# carry one: drop it after checking it equals model.embed_tokens.weight).
load_numpy_params = torch_gpt.load_numpy_params


def numpy_params(model: Llama) -> Dict[str, np.ndarray]:
    """The parameters as numpy arrays under HF names."""
    return {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
