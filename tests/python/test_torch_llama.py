#!/usr/bin/python3
"""Self-checks of tests/python/torch_llama.py, independent of keel.

Each check holds the float64 Llama reference to something written apart from
it: Meta's complex-number rotary on the unpermuted weights, Llama 3.1's rope
scaling worked out per frequency, explicit attention loops, a grouped-query
model expanded into plain multi-head attention, chunked runs at global
positions, torch.autograd.gradcheck, and the RMSNorm formula.

Run: /usr/bin/python3 tests/python/test_torch_llama.py   (exit 0 = all pass)
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import selfcheck  # noqa: E402  (fails, not skips, without torch)
from selfcheck import check, close  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_llama as tl  # noqa: E402


def rand_params(model, seed, std=0.3):
    selfcheck.rand_params(model, seed, lambda name: name.endswith("norm.weight"), std)


def tiny_cfg(**kw):
    base = dict(vocab_size=11, seq_len=16, n_layer=2, n_head=2, n_kv_head=2, n_embd=8, ffn_hidden=12,
                rope_theta=10000.0)
    base.update(kw)
    return tl.LlamaConfig(**base)


# ---------------------------------------------------------------- written apart from the module

def hand_inv_freq(d, theta, rs=None):
    """Per frequency, as Meta's apply_scaling states it (if / elif / else on the wavelength)."""
    out = []
    for i in range(d // 2):
        f = theta ** (-(2 * i) / d)
        if rs is not None:
            L = rs.original_max_position_embeddings
            wl = 2 * math.pi / f
            if wl < L / rs.high_freq_factor:
                pass
            elif wl > L / rs.low_freq_factor:
                f = f / rs.factor
            else:
                s = (L / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
                f = (1 - s) * f / rs.factor + s * f
        out.append(f)
    return out


def meta_rotary(x, freqs, positions):
    """Meta's apply_rotary_emb: x [B, T, H, d], pairs (2j, 2j+1) as complex numbers
    times exp(i * position * freq_j)."""
    B, T, H, d = x.shape
    xc = torch.view_as_complex(x.reshape(B, T, H, d // 2, 2).contiguous())
    ang = torch.outer(torch.tensor(positions, dtype=torch.float64), torch.tensor(freqs))
    rot = torch.polar(torch.ones_like(ang), ang).view(1, T, 1, d // 2)
    return torch.view_as_real(xc * rot).reshape(B, T, H, d)


def loop_linear(W, vec):
    return [sum(W[o, i].item() * vec[i] for i in range(W.shape[1])) for o in range(W.shape[0])]


def loop_rope(vec, pos, freqs):
    """HF convention written per pair: (v_j, v_{j+d/2}) rotated by pos * freq_j."""
    h = len(vec) // 2
    out = list(vec)
    for j in range(h):
        c, s = math.cos(pos * freqs[j]), math.sin(pos * freqs[j])
        out[j] = vec[j] * c - vec[j + h] * s
        out[j + h] = vec[j + h] * c + vec[j] * s
    return out


def loop_attention(attn, x, positions, freqs, n_head, n_kv_head):
    """Causal grouped-query attention with explicit loops: query head h reads
    kv head h // (n_head / n_kv_head); keys 0..t only."""
    B, T, C = x.shape
    d = attn.q_proj.weight.shape[0] // n_head
    rep = n_head // n_kv_head
    out = torch.empty(B, T, attn.o_proj.weight.shape[0])
    for b in range(B):
        rows = [[x[b, t, c].item() for c in range(C)] for t in range(T)]
        q = [loop_linear(attn.q_proj.weight, r) for r in rows]
        k = [loop_linear(attn.k_proj.weight, r) for r in rows]
        v = [loop_linear(attn.v_proj.weight, r) for r in rows]
        q = [[val for h in range(n_head) for val in loop_rope(q[t][h * d:(h + 1) * d], positions[t], freqs)]
             for t in range(T)]
        k = [[val for h in range(n_kv_head) for val in loop_rope(k[t][h * d:(h + 1) * d], positions[t], freqs)]
             for t in range(T)]
        for t in range(T):
            y = [0.0] * (n_head * d)
            for h in range(n_head):
                g = h // rep
                sc = [sum(q[t][h * d + i] * k[s][g * d + i] for i in range(d)) / math.sqrt(d) for s in range(t + 1)]
                m = max(sc)
                ex = [math.exp(z - m) for z in sc]
                z = sum(ex)
                for s in range(t + 1):
                    for i in range(d):
                        y[h * d + i] += ex[s] / z * v[s][g * d + i]
            out[b, t] = torch.tensor(loop_linear(attn.o_proj.weight, y))
    return out


def rel_close(a, b, tol, what):
    """Relative error, for frequencies that span many decades."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    return close(a / b, torch.ones_like(b), tol, what)


def formula_rmsnorm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def loop_rmsnorm(x, w, eps):
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        row = [x[i, j].item() for j in range(x.shape[1])]
        r = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        for j, v in enumerate(row):
            out[i, j] = v * r * w[j].item()
    return out


# ---------------------------------------------------------------- checks

@check
def names_and_shapes_are_hf():
    for tied in (False, True):
        cfg = tiny_cfg(vocab_size=13, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, ffn_hidden=24, tie_embeddings=tied)
        model = tl.Llama(cfg)
        got = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        C, d, V = 16, 4, 13
        exp = [("model.embed_tokens.weight", (V, C))]
        for i in range(2):
            p = f"model.layers.{i}."
            exp += [(p + "self_attn.q_proj.weight", (4 * d, C)), (p + "self_attn.k_proj.weight", (2 * d, C)),
                    (p + "self_attn.v_proj.weight", (2 * d, C)), (p + "self_attn.o_proj.weight", (C, 4 * d)),
                    (p + "mlp.gate_proj.weight", (24, C)), (p + "mlp.up_proj.weight", (24, C)),
                    (p + "mlp.down_proj.weight", (C, 24)), (p + "input_layernorm.weight", (C,)),
                    (p + "post_attention_layernorm.weight", (C,))]
        exp += [("model.norm.weight", (C,))] + ([] if tied else [("lm_head.weight", (V, C))])
        assert got == exp, f"tied={tied}: differ: {set(got) ^ set(exp)}"  # HF's names, in HF's order
        # loader round trip; it refuses missing, extra and misshapen tensors
        arrays = {n: np.random.default_rng(0).standard_normal(s).astype(np.float32) for n, s in exp}
        tl.load_numpy_params(model, arrays)
        back = tl.numpy_params(model)
        assert all(np.array_equal(back[n], arrays[n].astype(np.float64)) for n, _ in exp)
        bad_sets = [{k: v for k, v in arrays.items() if k != "model.norm.weight"},
                    {**arrays, "model.norm.weight": arrays["model.norm.weight"][:3]}]
        if tied:
            bad_sets.append({**arrays, "lm_head.weight": arrays["model.embed_tokens.weight"]})
        selfcheck.refuses(tl.load_numpy_params, model, bad_sets)
    model.init_weights(seed=0)
    assert abs(model.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 3e-3
    assert model.model.layers[1].input_layernorm.weight.eq(1).all() and model.model.norm.weight.eq(1).all()
    hf = tl.LlamaConfig.from_hf({"vocab_size": 128256, "max_position_embeddings": 131072, "num_hidden_layers": 32,
                                 "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                                 "intermediate_size": 14336, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                                 "tie_word_embeddings": False,
                                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert hf.head_dim == 128 and hf.n_rep == 4 and hf.rope_scaling == tl.RopeScaling()
    return f"{len(exp)} tensors tied, {len(exp) + 1} untied"


@check
def rmsnorm_matches_formula():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, generator=g) * 3 + 0.5
    norm = tl.LlamaRMSNorm(7, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(7, generator=g))
    e1 = close(norm(x), formula_rmsnorm(x, norm.weight, 1e-5), 1e-14, "rmsnorm vs formula")
    e2 = close(norm(x), loop_rmsnorm(x, norm.weight, 1e-5), 1e-13, "rmsnorm vs loop")  # float64 not narrowed
    # eps matters for small rows
    small = torch.full((1, 4), 1e-3)
    close(tl.LlamaRMSNorm(4, 1e-5)(small), small / math.sqrt(1e-6 + 1e-5), 1e-15, "eps")
    # low precision: normalised in float32, cast back, then weighted in the input dtype
    nb = tl.LlamaRMSNorm(7, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        nb.weight.copy_(norm.weight)
    xb = x.to(torch.bfloat16)
    yb = nb(xb)
    xf = xb.float()
    ref = nb.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, ref), "bfloat16 path"
    return f"formula err {e1:.1e}, loop err {e2:.1e}"


@check
def rotate_half_with_hf_permutation_equals_meta_complex():
    """The two published rotary conventions agree: HF's rotate-half on q/k rows
    permuted by the conversion script's permute == Meta's complex rotary on the
    original rows (then permuted), and the attention scores are identical."""
    out = []
    cases = [(2, 2, 8, None, 0), (4, 2, 8, tl.RopeScaling(8.0, 1.0, 4.0, 1024), 300), (3, 1, 6, None, 11)]
    for H, Hkv, d, rs, off in cases:
        C, T = H * d, 6
        cfg = tiny_cfg(n_head=H, n_kv_head=Hkv, n_embd=C, seq_len=512, rope_scaling=rs)
        g = torch.Generator().manual_seed(2 + H + d)
        wq, wk = torch.randn(H * d, C, generator=g), torch.randn(Hkv * d, C, generator=g)
        x = torch.randn(2, T, C, generator=g)
        pos = list(range(off, off + T))
        freqs = hand_inv_freq(d, cfg.rope_theta, rs)
        mq = meta_rotary((x @ wq.t()).view(2, T, H, d), freqs, pos)
        mk = meta_rotary((x @ wk.t()).view(2, T, Hkv, d), freqs, pos)
        # the conversion's row map, spelled out: HF row i*(d/2)+j of a head is Meta row 2j+i
        perm = [2 * j + i for i in range(2) for j in range(d // 2)]
        for w, n in ((wq, H), (wk, Hkv)):
            explicit = torch.stack([w[h * d + perm[r]] for h in range(n) for r in range(d)])
            assert torch.equal(tl.meta_to_hf_qk(w, n), explicit), "meta_to_hf_qk row map"
            assert torch.equal(tl.hf_to_meta_qk(tl.meta_to_hf_qk(w, n), n), w), "hf_to_meta_qk inverse"
        cos, sin = tl.rotary_cos_sin(cfg, T, off)
        hq = tl.apply_rotary((x @ tl.meta_to_hf_qk(wq, H).t()).view(2, T, H, d).transpose(1, 2), cos, sin)
        hk = tl.apply_rotary((x @ tl.meta_to_hf_qk(wk, Hkv).t()).view(2, T, Hkv, d).transpose(1, 2), cos, sin)
        e1 = close(hq.transpose(1, 2), mq[..., perm], 1e-12, f"q H={H} d={d}")
        close(hk.transpose(1, 2), mk[..., perm], 1e-12, f"k H={H} d={d}")
        rep = H // Hkv
        for h in range(H):
            s_hf = hq[:, h] @ hk[:, h // rep].transpose(-2, -1)
            s_meta = mq[:, :, h] @ mk[:, :, h // rep].transpose(-2, -1)
            close(s_hf, s_meta, 1e-11, f"scores head {h}")
        out.append(f"H={H},Hkv={Hkv},d={d}: {e1:.1e}")
    return "; ".join(out)


@check
def llama31_rope_scaling_bands():
    # no scaling: theta^(-2i/d)
    cfg = tiny_cfg(n_head=1, n_kv_head=1, n_embd=128, rope_theta=500000.0)
    plain = tl.inv_frequencies(cfg)
    rel_close(plain, torch.tensor(hand_inv_freq(128, 500000.0)), 1e-14, "unscaled")
    # factor 1 leaves every band unchanged: (1-s) f + s f = f
    same = tl.inv_frequencies(tiny_cfg(n_head=1, n_kv_head=1, n_embd=128, rope_theta=500000.0,
                                       rope_scaling=tl.RopeScaling(1.0, 1.0, 4.0, 8192)))
    rel_close(same, plain, 1e-15, "factor 1")
    # tiny, by hand: d=16, theta=1e4 -> f_i = 10^(-i/2), wavelengths 2*pi*10^(i/2);
    # L=64, low=1, high=4: unchanged below 16, divided by 8 above 64, blended in [16, 64]
    rs = tl.RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    got = tl.inv_frequencies(tiny_cfg(n_head=1, n_kv_head=1, n_embd=16, rope_scaling=rs))
    s1 = (64 / (2 * math.pi * 10 ** 0.5) - 1) / 3   # wavelength 19.87
    s2 = (64 / (2 * math.pi * 10) - 1) / 3          # wavelength 62.83
    by_hand = [1.0,
               (1 - s1) * 10 ** -0.5 / 8 + s1 * 10 ** -0.5,
               (1 - s2) * 0.1 / 8 + s2 * 0.1,
               10 ** -1.5 / 8, 10 ** -2 / 8, 10 ** -2.5 / 8, 10 ** -3 / 8, 10 ** -3.5 / 8]
    e = rel_close(got, torch.tensor(by_hand), 1e-14, "d=16 by hand")
    rel_close(got[2], 0.0125 + 0.0875 * s2, 1e-14, "medium band closed form")
    assert 0 < s2 < s1 < 1, (s1, s2)
    # Llama 3.1 8B/70B/405B: d=128, theta=5e5, factor 8, 1, 4, 8192
    cfg31 = tiny_cfg(n_head=1, n_kv_head=1, n_embd=128, rope_theta=500000.0, rope_scaling=tl.RopeScaling())
    scaled = tl.inv_frequencies(cfg31)
    rel_close(scaled, torch.tensor(hand_inv_freq(128, 500000.0, tl.RopeScaling())), 1e-14, "Llama 3.1")
    wl = 2 * math.pi / plain
    ratio = scaled / plain
    high, low = wl < 2048, wl > 8192
    mid = ~high & ~low
    assert high.sum() > 0 and low.sum() > 0 and mid.sum() > 0, "all three bands present"
    assert torch.equal(ratio[high], torch.ones(int(high.sum()))), "high band changed"
    close(ratio[low], torch.full((int(low.sum()),), 1 / 8), 1e-15, "low band / 8")
    assert ((ratio[mid] > 1 / 8) & (ratio[mid] < 1)).all() and (ratio[mid].diff() <= 0).all(), "medium band"
    # the reference's rotary uses exactly these frequencies
    cos, sin = tl.rotary_cos_sin(cfg31, 3, 1000)
    close(cos[2, :64], torch.cos(1002 * scaled), 1e-15, "cos table")
    close(sin[2, 64:], torch.sin(1002 * scaled), 1e-15, "sin table (second half repeats)")
    return f"bands high/mid/low {int(high.sum())}/{int(mid.sum())}/{int(low.sum())}, by-hand err {e:.1e}"


@check
def attention_matches_loops_mha_and_gqa():
    out = []
    for H, Hkv, off in ((2, 2, 0), (4, 2, 3), (4, 1, 5)):
        cfg = tiny_cfg(n_head=H, n_kv_head=Hkv, n_embd=4 * H)
        attn = tl.LlamaAttention(cfg)
        rand_params(attn, 3 + H + Hkv)
        x = torch.randn(2, 5, 4 * H, generator=torch.Generator().manual_seed(4))
        cos, sin = tl.rotary_cos_sin(cfg, 5, off)
        ref = loop_attention(attn, x, list(range(off, off + 5)), hand_inv_freq(4, cfg.rope_theta), H, Hkv)
        e = close(attn(x, cos, sin), ref, 1e-12, f"attention H={H} Hkv={Hkv}")
        x2 = x.clone()
        x2[:, 3:] += 1.0
        close(attn(x2, cos, sin)[:, :3], attn(x, cos, sin)[:, :3], 0.0, "causality")
        out.append(f"H={H},Hkv={Hkv}: {e:.1e}")
    return "; ".join(out)


@check
def gqa_gradients_sum_over_groups():
    """A grouped-query model equals the multi-head model whose k/v heads are
    copies (head j = kv head j // n_rep); each shared k/v head's gradient is the
    sum of what its copies receive, every other gradient is the same."""
    H, Hkv, d = 4, 2, 4
    gqa = tl.Llama(tiny_cfg(n_head=H, n_kv_head=Hkv, n_embd=H * d))
    mha = tl.Llama(tiny_cfg(n_head=H, n_kv_head=H, n_embd=H * d))
    rand_params(gqa, 5)
    src = dict(gqa.named_parameters())
    with torch.no_grad():
        for n, p in mha.named_parameters():
            if n.endswith(("k_proj.weight", "v_proj.weight")):
                p.copy_(src[n].view(Hkv, d, -1).repeat_interleave(H // Hkv, dim=0).reshape(p.shape))
            else:
                p.copy_(src[n])
    g = torch.Generator().manual_seed(6)
    idx = torch.randint(0, 11, (2, 7), generator=g)
    tgt = torch.randint(0, 11, (2, 7), generator=g)
    la, lossa = gqa(idx, tgt, position_offset=4)
    lb, lossb = mha(idx, tgt, position_offset=4)
    e = close(la, lb, 1e-13, "logits")
    lossa.backward()
    lossb.backward()
    grads_b = {n: p.grad for n, p in mha.named_parameters()}
    worst = 0.0
    for n, p in gqa.named_parameters():
        if n.endswith(("k_proj.weight", "v_proj.weight")):
            summed = grads_b[n].view(Hkv, H // Hkv, d, -1).sum(dim=1).reshape(p.shape)
            worst = max(worst, close(p.grad, summed, 1e-13, f"{n} group sum"))
            assert p.grad.abs().max() > 1e-6, f"{n}: no gradient"
        else:
            worst = max(worst, close(p.grad, grads_b[n], 1e-13, n))
    # the group sum is not the trivial case: the copies' gradients differ
    gb = grads_b["model.layers.0.self_attn.k_proj.weight"].view(H, d, -1)
    assert (gb[0] - gb[1]).abs().max() > 1e-6, "copies received the same gradient"
    return f"logits err {e:.1e}, grad err {worst:.1e}"


@check
def position_offset_is_global():
    T, half = 8, 4
    cfg = tiny_cfg(n_head=4, n_kv_head=2, n_embd=16, seq_len=32,
                   rope_scaling=tl.RopeScaling(4.0, 1.0, 4.0, 16))
    model = tl.Llama(cfg)
    rand_params(model, 7)
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, T, 16, generator=torch.Generator().manual_seed(8))
    # rotary alone: the second half at offset T/2 is the second half of the full run
    cf, sf = tl.rotary_cos_sin(cfg, T, 0)
    ch, sh = tl.rotary_cos_sin(cfg, half, half)
    qf, kf, vf = attn.project(x, cf, sf)
    qh, kh, vh = attn.project(x[:, half:], ch, sh)
    e1 = close(qh, qf[:, :, half:], 1e-14, "rotated q")
    close(kh, kf[:, :, half:], 1e-14, "rotated k")
    close(vh, vf[:, :, half:], 0.0, "v")
    c0, s0 = tl.rotary_cos_sin(cfg, half, 0)
    assert (attn.project(x[:, half:], c0, s0)[0] - qf[:, :, half:]).abs().max() > 1e-3, "offset had no effect"
    # a chunk's queries against all keys so far, by global position
    full = attn(x, cf, sf)
    chunk = attn.attend(qh, kf, vf, q_offset=half, k_offset=0)
    e2 = close(chunk, full[:, half:], 1e-13, "chunk attention")
    # RoPE is relative: a chunk attending only to itself does not see its offset
    idx = torch.randint(0, 11, (2, T), generator=torch.Generator().manual_seed(9))
    l0, _ = model(idx)
    l9, _ = model(idx, position_offset=9)
    e3 = close(l9, l0, 1e-12, "shift invariance")
    for bad in (-1, 32 - T + 1):
        try:
            model(idx, position_offset=bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"offset {bad} accepted beyond seq_len")
    return f"rotary {e1:.1e}, chunk {e2:.1e}, shift {e3:.1e}"


@check
def full_forward_matches_composition():
    """x = embed[tok]; x += attn(norm1 x); x += down(silu(gate) * up)(norm2 x); head(norm x); mean CE."""
    out = []
    for tied in (False, True):
        cfg = tiny_cfg(n_head=2, n_kv_head=1, n_embd=8, tie_embeddings=tied)
        model = tl.Llama(cfg)
        rand_params(model, 10 + tied, std=0.25)
        g = torch.Generator().manual_seed(11)
        idx = torch.randint(0, 11, (2, 5), generator=g)
        tgt = torch.randint(0, 11, (2, 5), generator=g)
        tgt[1, 2] = -100
        off = 2
        logits, loss = model(idx, tgt, position_offset=off)
        m = model.model
        x = m.embed_tokens.weight[idx]
        for layer in m.layers:
            a = layer.self_attn
            h = formula_rmsnorm(x, layer.input_layernorm.weight, cfg.norm_eps)
            x = x + loop_attention(a, h, list(range(off, off + 5)), hand_inv_freq(4, cfg.rope_theta), 2, 1)
            h = formula_rmsnorm(x, layer.post_attention_layernorm.weight, cfg.norm_eps)
            gate = h @ layer.mlp.gate_proj.weight.t()
            x = x + ((gate / (1 + torch.exp(-gate))) * (h @ layer.mlp.up_proj.weight.t())) @ layer.mlp.down_proj.weight.t()
        head = m.embed_tokens.weight if tied else model.lm_head.weight
        ref = formula_rmsnorm(x, m.norm.weight, cfg.norm_eps) @ head.t()
        e = close(logits, ref, 1e-12, f"logits tied={tied}")
        terms = []
        for b in range(2):
            for t in range(5):
                if tgt[b, t] == -100:
                    continue
                row = ref[b, t].tolist()
                mx = max(row)
                terms.append(-(row[int(tgt[b, t])] - mx - math.log(sum(math.exp(r - mx) for r in row))))
        close(loss, sum(terms) / len(terms), 1e-12, "cross-entropy (ignore_index -100)")
        out.append(f"tied={tied}: {e:.1e}")
    return "; ".join(out)


def functional_call(model, params, args):
    if hasattr(torch, "func"):
        return torch.func.functional_call(model, params, args)
    return torch.nn.utils.stateless.functional_call(model, params, args)


def gradcheck_model(cfg, seed, offset, names):
    model = tl.Llama(cfg)
    rand_params(model, seed, std=0.4)
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, cfg.vocab_size, (2, 4), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (2, 4), generator=g)
    inputs = [params[n].detach().clone().requires_grad_(True) for n in names]

    def objective(*ps):
        _, loss = functional_call(model, dict(zip(names, ps)), (idx, tgt, offset))
        return loss

    assert torch.autograd.gradcheck(objective, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=False)
    return sum(p.numel() for p in inputs)


@check
def gradcheck_variants():
    """Finite differences against autograd.  Each variant checks a few
    parameters (full gradcheck costs two forwards per scalar); together they
    cover every kind of parameter."""
    L = "model.layers.0."
    scaling = tl.RopeScaling(4.0, 1.0, 4.0, 16)  # d=4, theta=1e4: wavelength 6.3 blended, 628 divided
    variants = [
        (False, None, 2, [L + "self_attn.o_proj.weight", L + "input_layernorm.weight", "lm_head.weight"]),
        (True, None, 1, ["model.embed_tokens.weight", L + "self_attn.v_proj.weight",
                         L + "post_attention_layernorm.weight", "model.norm.weight"]),
        (False, scaling, 1, [L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "mlp.down_proj.weight"]),
        (True, scaling, 2, ["model.embed_tokens.weight", L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"]),
    ]
    covered = set()
    out = []
    for tied, rs, Hkv, names in variants:
        cfg = tiny_cfg(vocab_size=5, seq_len=8, n_layer=1, n_head=2, n_kv_head=Hkv, n_embd=8, ffn_hidden=6,
                       tie_embeddings=tied, rope_scaling=rs)
        n = gradcheck_model(cfg, 12 + Hkv + 2 * tied, 3, names)
        covered |= set(names)
        out.append(f"{'tied' if tied else 'untied'}/{'scaled' if rs else 'plain'}/kv{Hkv}: {n}")
    every = {n for n, _ in tl.Llama(tiny_cfg(n_layer=1)).named_parameters()}
    assert covered == every, f"not gradchecked: {sorted(every - covered)}"
    return ", ".join(out)


if __name__ == "__main__":
    sys.exit(selfcheck.main())
