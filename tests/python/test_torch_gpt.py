#!/usr/bin/python3
"""Self-checks of tests/python/torch_gpt.py, independent of keel.

Checks the float64 model's pieces against explicit loops (layer norm, GELU,
causal attention, MoE routing/gating/aux loss, padded-vocab cross-entropy),
its gradients with torch.autograd.gradcheck on tiny dense and MoE models,
the training step (microbatch accumulation, clipping, AdamW param groups
against a hand-written AdamW) and that float32 works too.

Run: /usr/bin/python3 tests/python/test_torch_gpt.py   (exit 0 = all pass)
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

import torch_gpt as tg  # noqa: E402


def rand_params(model, seed, std=0.3):
    is_norm_weight = lambda name: name.endswith(("ln_1.weight", "ln_2.weight")) or name == "ln_f.weight"  # noqa: E731
    selfcheck.rand_params(model, seed, is_norm_weight, std)


def tiny_cfg(**kw):
    base = dict(vocab_size=11, seq_len=6, n_layer=2, n_head=2, n_embd=8)
    base.update(kw)
    return tg.GPTConfig(**base)


# ---------------------------------------------------------------- loops

def loop_layernorm(x, w, b):
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        row = [x[i, j].item() for j in range(x.shape[1])]
        mu = sum(row) / len(row)
        var = sum((r - mu) ** 2 for r in row) / len(row)
        for j, r in enumerate(row):
            out[i, j] = (r - mu) / math.sqrt(var + 1e-5) * w[j].item() + b[j].item()
    return out


def loop_gelu(v):
    return 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def loop_linear(W, b, vec):
    out = []
    for o in range(W.shape[0]):
        s = sum(W[o, i].item() * vec[i] for i in range(W.shape[1]))
        out.append(s + (b[o].item() if b is not None else 0.0))
    return out


def loop_mlp(mlp, vec):
    h = [loop_gelu(v) for v in loop_linear(mlp.c_fc.weight, mlp.c_fc.bias, vec)]
    return loop_linear(mlp.c_proj.weight, mlp.c_proj.bias, h)


def loop_attention(attn, x, n_head):
    B, T, C = x.shape
    d = C // n_head
    out = torch.empty_like(x)
    for b in range(B):
        qkv = [loop_linear(attn.c_attn.weight, attn.c_attn.bias, [x[b, t, c].item() for c in range(C)])
               for t in range(T)]
        for t in range(T):
            y = [0.0] * C
            for h in range(n_head):
                q = [qkv[t][h * d + i] for i in range(d)]
                scores = []
                for s in range(t + 1):  # causal: keys 0..t only
                    k = [qkv[s][C + h * d + i] for i in range(d)]
                    scores.append(sum(qi * ki for qi, ki in zip(q, k)) / math.sqrt(d))
                m = max(scores)
                ex = [math.exp(sc - m) for sc in scores]
                z = sum(ex)
                for s in range(t + 1):
                    v = [qkv[s][2 * C + h * d + i] for i in range(d)]
                    for i in range(d):
                        y[h * d + i] += ex[s] / z * v[i]
            proj = loop_linear(attn.c_proj.weight, attn.c_proj.bias, y)
            for c in range(C):
                out[b, t, c] = proj[c]
    return out


def loop_moe(moe, x, E, k, coef):
    B, T, C = x.shape
    N = B * T
    out = torch.empty_like(x)
    counts = [0] * E
    psum = [0.0] * E
    for u in range(N):
        b, t = divmod(u, T)
        vec = [x[b, t, c].item() for c in range(C)]
        logits = loop_linear(moe.router.weight, None, vec)
        m = max(logits)
        ex = [math.exp(l - m) for l in logits]
        probs = [e / sum(ex) for e in ex]
        chosen = sorted(range(E), key=lambda e: (-probs[e], e))[:k]  # ties -> lower index
        wsum = sum(probs[e] for e in chosen)
        acc = [0.0] * C
        for e in chosen:
            y = loop_mlp(moe.experts[e], vec)
            for c in range(C):
                acc[c] += probs[e] / wsum * y[c]
            counts[e] += 1
        for e in range(E):
            psum[e] += probs[e]
        for c in range(C):
            out[b, t, c] = acc[c]
    aux = coef * E * sum(counts[e] / (N * k) * psum[e] / N for e in range(E))
    return out, aux


# ---------------------------------------------------------------- checks

@check
def layernorm_and_gelu_match_loops():
    torch.manual_seed(0)
    x = torch.randn(5, 7) * 3 + 1
    w, b = torch.randn(7), torch.randn(7)
    err1 = close(F.layer_norm(x, (7,), w, b, eps=tg.LN_EPS), loop_layernorm(x, w, b), 1e-12, "layernorm")
    v = torch.linspace(-6, 6, 101)
    ref = torch.tensor([loop_gelu(t.item()) for t in v])
    err2 = close(F.gelu(v, approximate="tanh"), ref, 1e-14, "gelu")
    return f"layernorm err {err1:.1e}, gelu err {err2:.1e}"


@check
def attention_matches_loops():
    cfg = tiny_cfg(n_head=2, n_embd=8, seq_len=6)
    blk = tg.Block(cfg, 0)
    rand_params(blk, 1)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))  # T < seq_len too
    err = close(blk.attn(x), loop_attention(blk.attn, x, cfg.n_head), 1e-12, "attention")
    # causality: changing a later token does not move earlier outputs
    x2 = x.clone()
    x2[:, 3:] += 1.0
    close(blk.attn(x2)[:, :3], blk.attn(x)[:, :3], 0.0, "causality")
    return f"max err {err:.1e}"


@check
def moe_matches_loops():
    out = []
    for E, k in [(4, 2), (3, 1), (4, 4)]:
        cfg = tiny_cfg(n_expert=E, top_k=k, moe_every=1, aux_loss_coef=0.05)
        moe = tg.MoE(cfg)
        rand_params(moe, 3 + E + k, std=0.5)
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(4))
        y, aux = moe(x)
        ref_y, ref_aux = loop_moe(moe, x, E, k, 0.05)
        e1 = close(y, ref_y, 1e-12, f"moe out E={E} k={k}")
        e2 = close(aux, ref_aux, 1e-14, f"moe aux E={E} k={k}")
        out.append(f"E={E},k={k}: out {e1:.1e} aux {e2:.1e}")
    return "; ".join(out)


@check
def moe_ties_go_to_lower_index():
    cfg = tiny_cfg(n_expert=4, top_k=2, moe_every=1)
    moe = tg.MoE(cfg)
    rand_params(moe, 5)
    with torch.no_grad():
        moe.router.weight.zero_()  # all probs equal
    p = torch.full((3, 4), 0.25)
    _, idx = tg.top_k_lowest_index(p, 2)
    assert idx.tolist() == [[0, 1]] * 3, idx
    p = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.4, 0.1, 0.4, 0.1]])
    _, idx = tg.top_k_lowest_index(p, 2)
    assert idx.tolist() == [[1, 2], [0, 2]], idx
    x = torch.randn(1, 4, 8)
    y, aux = moe(x)
    ref = (moe.experts[0](x) + moe.experts[1](x)) / 2
    close(y, ref, 1e-13, "tied routing output")
    # f = [.5, .5, 0, 0], P = .25 each -> coef * E * .25
    close(aux, cfg.aux_loss_coef * 4 * 0.25, 1e-15, "tied aux")
    return "ok"


@check
def padded_vocab_does_not_enter_loss():
    cfg = tiny_cfg()
    assert cfg.padded_vocab == 128
    model = tg.GPT(cfg)
    rand_params(model, 6, std=0.1)
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, cfg.vocab_size, (2, 6), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (2, 6), generator=g)
    logits, loss, aux = model(idx, tgt)
    assert logits.shape == (2, 6, 128) and aux.item() == 0.0
    ref = 0.0
    for b in range(2):
        for t in range(6):
            row = logits[b, t, :cfg.vocab_size].tolist()
            m = max(row)
            ref += -(row[tgt[b, t]] - m - math.log(sum(math.exp(r - m) for r in row)))
    close(loss, ref / 12, 1e-13, "cross-entropy")
    with torch.no_grad():
        model.wte[cfg.vocab_size:] = 50.0  # huge padded logits: loss must not move
    _, loss2, _ = model(idx, tgt)
    close(loss2, loss, 0.0, "padded columns")
    loss2.backward()
    assert model.wte.grad[cfg.vocab_size:].abs().max().item() == 0.0, "padded rows got gradient"
    return f"loss {loss.item():.6f}"


@check
def full_forward_matches_composition():
    """Pre-LN wiring: x = wte[tok] + wpe[t]; x += attn(ln_1 x); x += mlp/moe(ln_2 x); ln_f x @ wte^T."""
    cfg = tiny_cfg(n_layer=2, n_expert=3, top_k=2, moe_every=2)
    model = tg.GPT(cfg)
    rand_params(model, 8, std=0.2)
    idx = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(9))
    logits, _, aux = model(idx)
    x = model.wte[idx] + model.wpe[:6]
    aux_ref = 0.0
    for i, blk in enumerate(model.h):
        x = x + loop_attention(blk.attn, loop_layernorm(x.reshape(-1, 8), blk.ln_1.weight, blk.ln_1.bias).view(2, 6, 8), 2)
        h = loop_layernorm(x.reshape(-1, 8), blk.ln_2.weight, blk.ln_2.bias).view(2, 6, 8)
        if cfg.is_moe_layer(i):
            assert hasattr(blk, "moe") and not hasattr(blk, "mlp")
            y, a = loop_moe(blk.moe, h, 3, 2, cfg.aux_loss_coef)
            aux_ref += a
        else:
            assert hasattr(blk, "mlp") and not hasattr(blk, "moe")
            y = torch.tensor([[loop_mlp(blk.mlp, h[b, t].tolist()) for t in range(6)] for b in range(2)])
        x = x + y
    xf = loop_layernorm(x.reshape(-1, 8), model.ln_f.weight, model.ln_f.bias)
    ref = (xf @ model.wte.t()).view(2, 6, -1)
    e = close(logits, ref, 1e-11, "logits")
    close(aux, aux_ref, 1e-14, "aux")
    return f"logits err {e:.1e}"


@check
def names_and_shapes_are_keels():
    cfg = tiny_cfg(vocab_size=200, seq_len=32, n_layer=2, n_head=4, n_embd=64, n_expert=4, moe_every=2)
    model = tg.GPT(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    C, Vp = 64, 256
    exp = {"wte": (Vp, C), "wpe": (32, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(2):
        p = f"h.{i}."
        exp.update({p + "ln_1.weight": (C,), p + "ln_1.bias": (C,), p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
                    p + "attn.c_attn.weight": (3 * C, C), p + "attn.c_attn.bias": (3 * C,),
                    p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,)})
        mlps = [p + "mlp."] if i == 0 else [p + f"moe.experts.{e}." for e in range(4)]
        if i == 1:
            exp[p + "moe.router.weight"] = (4, C)
        for m in mlps:
            exp.update({m + "c_fc.weight": (4 * C, C), m + "c_fc.bias": (4 * C,),
                        m + "c_proj.weight": (C, 4 * C), m + "c_proj.bias": (C,)})
    assert shapes == exp, f"differ: {set(shapes.items()) ^ set(exp.items())}"
    # loader round trip, and it refuses wrong names / shapes
    arrays = {n: np.random.default_rng(0).standard_normal(s).astype(np.float32) for n, s in exp.items()}
    tg.load_numpy_params(model, arrays)
    assert np.array_equal(model.h[1].moe.router.weight.detach().numpy(), arrays["h.1.moe.router.weight"].astype(np.float64))
    selfcheck.refuses(tg.load_numpy_params, model,
                      [{k: v for k, v in arrays.items() if k != "wpe"}, {**arrays, "wpe": arrays["wpe"][:3]}])
    # init distributions
    model.init_weights(seed=0)
    assert abs(model.h[0].mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(4)) < 1e-3
    assert abs(model.wte.std().item() - 0.02) < 1e-3 and model.h[0].ln_1.weight.eq(1).all()
    return f"{len(shapes)} tensors"


def gradcheck_model(cfg, seed):
    model = tg.GPT(cfg)
    rand_params(model, seed, std=0.3)
    names, params = zip(*model.named_parameters())
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    inputs = [p.detach().clone().requires_grad_(True) for p in params]

    def objective(*ps):
        out = torch.func.functional_call(model, dict(zip(names, ps)), (idx, tgt)) if hasattr(torch, "func") \
            else torch.nn.utils.stateless.functional_call(model, dict(zip(names, ps)), (idx, tgt))
        _, loss, aux = out
        return loss + aux

    ok = torch.autograd.gradcheck(objective, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=False)
    assert ok
    return sum(p.numel() for p in params)


@check
def gradcheck_dense():
    n = gradcheck_model(tiny_cfg(vocab_size=5, seq_len=4, n_layer=1, n_head=2, n_embd=4), 10)
    return f"{n} parameters"


@check
def gradcheck_moe():
    cfg = tiny_cfg(vocab_size=5, seq_len=4, n_layer=2, n_head=2, n_embd=4, n_expert=3, top_k=2, moe_every=2,
                   aux_loss_coef=0.1)
    n = gradcheck_model(cfg, 11)
    return f"{n} parameters (CE + aux)"


def manual_adamw(params_np, grads_np, decay_mask, lr, b1, b2, eps, wd, steps_state):
    out = []
    for p, g, dec, st in zip(params_np, grads_np, decay_mask, steps_state):
        st["t"] += 1
        st["m"] = b1 * st["m"] + (1 - b1) * g
        st["v"] = b2 * st["v"] + (1 - b2) * g * g
        mhat = st["m"] / (1 - b1 ** st["t"])
        vhat = st["v"] / (1 - b2 ** st["t"])
        if dec:
            p = p * (1 - lr * wd)
        out.append(p - lr * mhat / (np.sqrt(vhat) + eps))
    return out


@check
def train_step_matches_manual_recipe():
    cfg = tiny_cfg(vocab_size=13, seq_len=8, n_layer=2, n_head=2, n_embd=8)
    g = torch.Generator().manual_seed(12)
    idx = torch.randint(0, cfg.vocab_size, (4, 8), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (4, 8), generator=g)
    model = tg.GPT(cfg)
    rand_params(model, 13, std=0.2)
    names, params = zip(*model.named_parameters())
    p0 = [p.detach().numpy().copy() for p in params]
    b1, b2, eps, wd, clip = 0.9, 0.95, 1e-8, 0.1, 0.05
    opt = tg.make_optimizer(model, lr=0.0, betas=(b1, b2), eps=eps, weight_decay=wd)
    # the decay groups: 2-D only
    decay_names = {n for n, p in model.named_parameters() if any(p is q for q in opt.param_groups[0]["params"])}
    assert decay_names == {n for n in names if not n.endswith(".bias") and not n.startswith("ln_f")
                           and ".ln_" not in n}, decay_names
    state = [{"t": 0, "m": 0.0, "v": 0.0} for _ in params]
    ref = p0
    for step, lr in enumerate([1e-2, 2e-2, 5e-3]):
        # reference gradient: whole batch in one go (dense: mean of equal-size microbatch means is the mean)
        ref_model = tg.GPT(cfg)
        tg.load_numpy_params(ref_model, dict(zip(names, ref)))
        _, loss_full, _ = ref_model(idx, tgt)
        loss_full.backward()
        grads = [p.grad.numpy().copy() for p in ref_model.parameters()]
        norm = math.sqrt(sum(float((gr ** 2).sum()) for gr in grads))
        coef = min(1.0, clip / (norm + 1e-6))
        grads = [gr * coef for gr in grads]
        ce_half = []
        for m in range(2):
            _, l, _ = ref_model(idx[2 * m:2 * m + 2], tgt[2 * m:2 * m + 2])
            ce_half.append(l.item())
        ref = manual_adamw(ref, grads, [n in decay_names for n in names], lr, b1, b2, eps, wd, state)

        loss, gnorm = tg.train_step(model, opt, idx, tgt, micro_batches=2, grad_clip=clip, lr=lr)
        close(loss, sum(ce_half) / 2, 1e-13, f"step {step} reported loss")
        close(gnorm, norm, 1e-12 * norm, f"step {step} grad norm")
        assert norm > clip, "test meant to exercise clipping"
    err = max(close(p.detach(), r, 1e-12, n) for n, p, r in zip(names, params, ref))
    return f"3 steps, max param err {err:.1e}"


@check
def moe_train_step_runs_and_learns_float32():
    cfg = tiny_cfg(vocab_size=20, seq_len=16, n_layer=2, n_head=2, n_embd=16, n_expert=4, top_k=2, moe_every=2)
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(14)
        model = tg.GPT(cfg).to(dtype)
        model.init_weights(seed=1)
        assert all(p.dtype == dtype for p in model.parameters())
        opt = tg.make_optimizer(model, lr=3e-3)
        idx = torch.randint(0, 20, (4, 16))
        tgt = torch.randint(0, 20, (4, 16))
        losses = []
        for s in range(30):
            loss, norm = tg.train_step(model, opt, idx, tgt, micro_batches=2, grad_clip=1.0,
                                       lr=tg.lr_schedule(s, 3e-3, 3, 30, 0.1))
            assert math.isfinite(loss) and math.isfinite(norm)
            losses.append(loss)
        assert losses[-1] < losses[0] - 0.5, f"{dtype}: loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"
        logits, _, _ = model(idx)
        assert logits.dtype == dtype
    # no grad clip path
    loss, norm = tg.train_step(model, opt, idx, tgt, micro_batches=1, grad_clip=0.0, lr=1e-3)
    assert norm > 0
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


@check
def shard_round_trip():
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        toks = np.random.default_rng(0).integers(0, 200, 1000).astype(np.uint16)
        path = os.path.join(d, "s.bin")
        tg.write_llmc_shard(path, toks)
        assert os.path.getsize(path) == 1024 + 2000
        assert np.array_equal(tg.read_llmc_shard(path), toks)
    return "ok"


if __name__ == "__main__":
    sys.exit(selfcheck.main())
