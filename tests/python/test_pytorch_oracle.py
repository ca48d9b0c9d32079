#!/usr/bin/python3
"""PyTorch oracle for keel's single-rank CPU trainer.

    /usr/bin/python3 tests/python/test_pytorch_oracle.py \
        --dump-tool build/bin/keel-oracle-dump --config tests/python/oracle_dense.toml

Makes a random-token llm.c shard, runs keel-oracle-dump on the config (which
writes keel's initial weights, one forward/backward and a short training
run as .npy files), rebuilds the same model in PyTorch float64 from keel's
initial weights and compares. The reference is chosen by the config's
model.arch: "gpt2" -> tests/python/torch_gpt.py, "llama" ->
tests/python/torch_llama.py (Hugging Face names, keel's defaults for the
keys left at 0; see ARCHS). Tolerances, gpt2 / llama:

  logits            max|keel - torch| / max|torch|        <= 1e-5 / 1e-5
  CE loss           relative                              <= 1e-5 / 1e-6
  aux loss          relative (absolute when torch's is 0) <= 1e-5 / 1e-5
  each gradient     max|keel - torch| / max|torch grad|   <= 1e-4 / 1e-5
  each step's loss  relative                              <= 1e-5 / 1e-6
  each grad norm    relative                              <= 1e-4 / 1e-5
  each lr           relative                              <= 1e-6 / 1e-6

Both families keep keel's padded vocabulary: the token embedding (and an
untied head) has padded_vocab rows, the logits padded_vocab columns, and
only the first vocab_size columns take part in the cross-entropy. The padded
logit columns and gradient rows are compared with the rest (PyTorch's
gradient rows there are exactly zero).

The learning rates are not keel's: the PyTorch run takes them from
torch.optim.lr_scheduler.LambdaLR with the documented schedule (linear
warmup, then cosine to lr * min_lr_ratio at the last step), and keel's
reported rate (float32) is held to it.

Exit status 0 only when everything passes. Without torch it fails (exit 1);
it never skips.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except Exception as e:  # must FAIL, not skip
    print(f"FAIL: the PyTorch oracle needs torch and numpy, and {sys.executable} cannot import them: {e!r}\n"
          f"Run it with Debian's interpreter (/usr/bin/python3, python3-torch), "
          f"e.g. cmake -DKEEL_SYSTEM_PYTHON=/usr/bin/python3.", flush=True)
    sys.exit(1)

import tomllib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt as tg  # noqa: E402
import torch_llama as tl  # noqa: E402

SHARD_TOKENS = 20000


# ----------------------------------------------------------------------------
# What differs by model.arch: the reference model, built from keel's
# resolved [model] section (meta.json), and the tolerances. Everything else
# (loading keel's tensors, the comparisons, the training run) is shared.
#
# Weight decay needs no entry: keel decays every 2-D tensor and nothing else
# (ParamSpec::weight_decay in trainer/params/parameters.h, the same rule for
# every family), which is tg.make_optimizer's rule. Under Llama that decays
# model.embed_tokens, q/k/v/o_proj, gate/up/down_proj and lm_head, and not
# the RMSNorm weights.

TOL_GPT2 = dict(logits=1e-5, loss=1e-5, aux=1e-5, grad=1e-4, step_loss=1e-5, grad_norm=1e-4,
                lr=1e-6)  # keel's rate comes as float32
TOL_LLAMA = dict(TOL_GPT2, loss=1e-6, grad=1e-5, step_loss=1e-6, grad_norm=1e-5)


def padded_vocab(vocab_size):
    """keel's ModelConfig::padded_vocab(): vocab_size rounded up to a multiple of 128."""
    return (int(vocab_size) + 127) // 128 * 128


class PaddedLlama(tl.Llama):
    """torch_llama.Llama over keel's padded vocabulary, called like torch_gpt.GPT.

    The embedding (and an untied lm_head) has padded_vocab rows, as keel's
    tensors do; the logits keep all padded_vocab columns, and the
    cross-entropy takes the first vocab_size only (the padded columns never
    take part, as in torch_gpt.GPT). A dense model has no aux loss: 0."""

    def __init__(self, cfg: tl.LlamaConfig, vocab_size: int):
        super().__init__(cfg)
        self.vocab_size = int(vocab_size)

    def forward(self, idx, targets=None):
        logits, _ = super().forward(idx)
        loss = None
        if targets is not None:
            V = self.vocab_size
            loss = torch.nn.functional.cross_entropy(logits[..., :V].reshape(-1, V), targets.reshape(-1).long())
        return logits, loss, logits.new_zeros(())


def llama_config(m):
    """tl.LlamaConfig from keel's [model] section, with keel's defaults for the
    keys left at 0 (common/config.h ModelConfig, common/config.cpp mlp_width),
    and vocab_size the padded vocabulary (see PaddedLlama)."""
    C = int(m["n_embd"])
    ffn = int(m.get("ffn_hidden", 0))
    if ffn <= 0:  # Meta's rule: int(8C/3) rounded up to a multiple of 256
        ffn = (8 * C // 3 + 255) // 256 * 256
    scaling = None
    if float(m.get("rope_scaling_factor", 0)) > 0:  # 0: no scaling (Llama 3.0)
        scaling = tl.RopeScaling(factor=float(m["rope_scaling_factor"]),
                                 low_freq_factor=float(m.get("rope_low_freq_factor", 0)) or 1.0,
                                 high_freq_factor=float(m.get("rope_high_freq_factor", 0)) or 4.0,
                                 original_max_position_embeddings=int(m.get("rope_original_context", 0)) or 8192)
    return tl.LlamaConfig(vocab_size=padded_vocab(m["vocab_size"]), seq_len=int(m["seq_len"]),
                          n_layer=int(m["n_layer"]), n_head=int(m["n_head"]),
                          n_kv_head=int(m.get("n_kv_head", 0)) or int(m["n_head"]), n_embd=C, ffn_hidden=ffn,
                          rope_theta=float(m.get("rope_theta", 0)) or 500000.0, rope_scaling=scaling,
                          norm_eps=float(m.get("norm_eps", 0)) or 1e-5,
                          tie_embeddings=bool(m.get("tie_embeddings", True)))


def gpt2_reference(m):
    cfg = tg.GPTConfig.from_dict(m)
    return cfg, lambda: tg.GPT(cfg).double()


def llama_reference(m):
    if int(m.get("n_expert", 0)) > 0:
        raise ValueError("the Llama reference (tests/python/torch_llama.py) has no MoE blocks")
    cfg = llama_config(m)
    return cfg, lambda: PaddedLlama(cfg, int(m["vocab_size"])).double()


# arch -> (reference(model section) -> (config to print, fresh float64 model factory), tolerances)
ARCHS = {"gpt2": (gpt2_reference, TOL_GPT2), "llama": (llama_reference, TOL_LLAMA)}


class Report:
    def __init__(self):
        self.rows = []  # (check, item, error, tolerance, ok, note)

    def add(self, check, item, error, tol, note=""):
        ok = bool(np.isfinite(error)) and error <= tol
        self.rows.append((check, item, float(error), tol, ok, note))
        return ok

    def fail(self, check, item, note):
        self.rows.append((check, item, float("nan"), float("nan"), False, note))

    @property
    def ok(self):
        return all(r[4] for r in self.rows)

    def print_table(self, title, rows=None):
        rows = self.rows if rows is None else rows
        print(f"\n{title}")
        w0 = max([len("check")] + [len(r[0]) for r in rows])
        w1 = max([len("item")] + [len(r[1]) for r in rows])
        print(f"  {'check':{w0}}  {'item':{w1}}  {'error':>10}  {'tolerance':>9}  result")
        for check, item, err, tol, ok, note in rows:
            print(f"  {check:{w0}}  {item:{w1}}  {err:10.3e}  {tol:9.1e}  {'pass' if ok else 'FAIL'}"
                  + (f"  {note}" if note else ""))


def rel(a, b):
    """|a - b| / |b| (absolute when b is 0)."""
    a, b = float(a), float(b)
    return abs(a - b) / abs(b) if b != 0 else abs(a - b)


def max_rel(a, b):
    """max|a - b| / max|b| over a tensor (absolute when b is all zero)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf"), 0.0
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return (err / scale if scale > 0 else err), scale


def load(out, name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"keel-oracle-dump did not write {path}")
    return np.load(path)


def run_dump(args, tmp):
    with open(args.config, "rb") as f:
        toml_cfg = tomllib.load(f)
    vocab = int(toml_cfg.get("model", {}).get("vocab_size", 256))
    steps = args.steps if args.steps is not None else int(toml_cfg.get("train", {}).get("steps", 10))
    shard = os.path.join(tmp, "train_000000.bin")
    rng = np.random.default_rng(args.seed)
    tg.write_llmc_shard(shard, rng.integers(0, vocab, SHARD_TOKENS, dtype=np.int64).astype(np.uint16))
    out = os.path.join(tmp, "dump")
    cmd = [os.path.abspath(args.dump_tool), "--config", os.path.abspath(args.config),
           "--set", f"data.train={shard}",
           "--set", f"job.run_dir={os.path.join(tmp, 'run')}",
           "--out", out, "--steps", str(steps)]
    print("running: " + " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=args.timeout)
    except FileNotFoundError:
        print(f"FAIL: dump tool not found: {args.dump_tool}")
        sys.exit(1)
    except subprocess.TimeoutExpired as e:
        print(f"FAIL: dump tool ran past {args.timeout} s\n{e.output or ''}")
        sys.exit(1)
    if proc.returncode != 0:
        print(f"FAIL: dump tool exited with status {proc.returncode}; its output:\n{proc.stdout}")
        sys.exit(1)
    if args.verbose:
        print(proc.stdout)
    return out


def compare(out, rep):
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    conf = meta["config"]
    arch = conf["model"].get("arch", "gpt2")
    if arch not in ARCHS:
        rep.fail("meta", "model.arch", f"no PyTorch reference for arch {arch!r} (known: {sorted(ARCHS)})")
        return meta
    reference, tol = ARCHS[arch]
    mcfg, new_model = reference(conf["model"])
    tcfg = conf["train"]
    micro = int(conf.get("parallel", {}).get("micro_batches", 1))
    steps = int(meta["steps"])
    print(f"model ({arch}): {mcfg}\ntrain: batch {tcfg['batch_size']}, micro_batches {micro}, steps {steps}, "
          f"grad_clip {tcfg['grad_clip']}, wd {tcfg['weight_decay']}, betas ({tcfg['beta1']}, {tcfg['beta2']}), "
          f"eps {tcfg['eps']}")

    vocab, vp = int(conf["model"]["vocab_size"]), padded_vocab(conf["model"]["vocab_size"])
    if int(meta["padded_vocab"]) != vp:
        rep.fail("meta", "padded_vocab", f"keel {meta['padded_vocab']}, expected {vp}")
        return meta
    model = new_model()
    torch_names = tg.param_names(model)
    keel_names = list(meta["param_names"])
    if sorted(torch_names) != sorted(keel_names) or len(set(keel_names)) != len(keel_names):
        rep.fail("meta", "param_names",
                 f"only keel: {sorted(set(keel_names) - set(torch_names))}, "
                 f"only torch: {sorted(set(torch_names) - set(keel_names))}")
        return meta
    init = {n: load(out, f"init/{n}.npy") for n in keel_names}
    bad = [n for n, a in init.items() if a.dtype != np.float32]
    if bad:
        rep.fail("meta", "init dtype", f"not float32: {bad}")
    tg.load_numpy_params(model, init)  # checks shapes

    # ---- one forward / backward on the step-0 batch
    x = load(out, "check_inputs.npy")
    y = load(out, "check_targets.npy")
    B, T = int(tcfg["batch_size"]), int(conf["model"]["seq_len"])
    shape_ok = x.shape == (B, T) and y.shape == (B, T) and x.dtype == np.int32 and y.dtype == np.int32
    tokens_ok = shape_ok and x.min() >= 0 and x.max() < vocab and y.min() >= 0 and y.max() < vocab
    rep.add("batch", "check_inputs/targets: int32 [B,T], tokens < V", 0.0 if tokens_ok else float("inf"), 0.0)
    if not tokens_ok:
        return meta
    xt, yt = torch.from_numpy(x).long(), torch.from_numpy(y).long()
    logits, loss, aux = model(xt, yt)
    (loss + aux).backward()

    k_logits = load(out, "check_logits.npy")
    err, scale = max_rel(k_logits, logits.detach().numpy())
    rep.add("forward", f"logits {list(k_logits.shape)}", err, tol["logits"], f"max|logit| {scale:.3g}")
    k_loss = float(load(out, "check_loss.npy").reshape(-1)[0])
    rep.add("forward", "CE loss", rel(k_loss, loss.item()), tol["loss"], f"keel {k_loss:.9g}, torch {loss.item():.9g}")
    k_aux = float(load(out, "check_aux_loss.npy").reshape(-1)[0])
    rep.add("forward", "aux loss", rel(k_aux, aux.item()), tol["aux"], f"keel {k_aux:.9g}, torch {aux.item():.9g}")

    params = dict(model.named_parameters())
    for n in keel_names:
        g = params[n].grad
        g = np.zeros(params[n].shape) if g is None else g.numpy()
        kg = load(out, f"check_grads/{n}.npy")
        err, scale = max_rel(kg, g)
        rep.add("gradient", n, err, tol["grad"], f"max|g| {scale:.3g}" if kg.shape == g.shape
                else f"shape {kg.shape} vs {g.shape}")

    # ---- N training steps from the same initial model
    ti = load(out, "train_inputs.npy")
    tt = load(out, "train_targets.npy")
    k_losses = load(out, "train_losses.npy").reshape(-1)
    k_lrs = load(out, "train_lrs.npy").reshape(-1)
    k_norms = load(out, "train_grad_norms.npy").reshape(-1)
    if ti.shape != (steps, B, T) or tt.shape != (steps, B, T) or len(k_losses) != steps \
            or len(k_lrs) != steps or len(k_norms) != steps:
        rep.fail("train", "shapes", f"inputs {ti.shape}, targets {tt.shape}, losses {k_losses.shape}, "
                 f"lrs {k_lrs.shape}, norms {k_norms.shape}; expected {steps} steps of [{B},{T}]")
        return meta
    same = np.array_equal(ti[0], x) and np.array_equal(tt[0], y)
    rep.add("batch", "check batch == step-0 batch", 0.0 if same else float("inf"), 0.0)

    model = new_model()
    tg.load_numpy_params(model, init)
    opt = tg.make_optimizer(model, lr=float(tcfg["lr"]), betas=(float(tcfg["beta1"]), float(tcfg["beta2"])),
                            eps=float(tcfg["eps"]), weight_decay=float(tcfg["weight_decay"]))
    warmup, total, min_ratio = int(tcfg["warmup_steps"]), int(tcfg["steps"]), float(tcfg["min_lr_ratio"])
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: tg.lr_schedule(step, 1.0, warmup, total, min_ratio))
    print(f"\n  step  {'lr':>10}  {'keel loss':>12}  {'torch loss':>12}  {'rel err':>9}  "
          f"{'keel norm':>10}  {'torch norm':>10}  {'rel err':>9}")
    for s in range(steps):
        lr = schedule.get_last_lr()[0]
        t_loss, t_norm = tg.train_step(model, opt, torch.from_numpy(ti[s]).long(), torch.from_numpy(tt[s]).long(),
                                       micro_batches=micro, grad_clip=float(tcfg["grad_clip"]))
        schedule.step()
        e_loss, e_norm = rel(k_losses[s], t_loss), rel(k_norms[s], t_norm)
        print(f"  {s:4d}  {lr:10.4e}  {k_losses[s]:12.8f}  {t_loss:12.8f}  {e_loss:9.2e}  "
              f"{k_norms[s]:10.6f}  {t_norm:10.6f}  {e_norm:9.2e}")
        rep.add("train loss", f"step {s}", e_loss, tol["step_loss"])
        rep.add("train grad norm", f"step {s}", e_norm, tol["grad_norm"])
        rep.add("train lr", f"step {s}", rel(k_lrs[s], lr), tol["lr"], f"keel {float(k_lrs[s]):.6g}, torch {lr:.6g}")
    return meta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump-tool", required=True, help="path of keel-oracle-dump")
    ap.add_argument("--config", required=True, help="keel TOML config (its data.train is replaced)")
    ap.add_argument("--steps", type=int, default=None, help="training steps to compare (default: train.steps)")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the random-token shard")
    ap.add_argument("--timeout", type=float, default=540, help="seconds the dump tool may run")
    ap.add_argument("--keep", metavar="DIR", help="keep the shard and dump in DIR instead of a temp dir")
    ap.add_argument("--verbose", action="store_true", help="print the dump tool's output")
    args = ap.parse_args()

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    print(f"torch {torch.__version__}, numpy {np.__version__}, python {sys.executable}")
    rep = Report()
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        tmp_ctx = None
        tmp = os.path.abspath(args.keep)
    else:
        tmp_ctx = tempfile.TemporaryDirectory(prefix="keel-oracle-")
        tmp = tmp_ctx.name
    try:
        out = run_dump(args, tmp)
        try:
            compare(out, rep)
        except (FileNotFoundError, KeyError, ValueError) as e:
            rep.fail("dump", "contents", f"{type(e).__name__}: {e}")
    finally:
        if tmp_ctx is not None:
            tmp_ctx.cleanup()

    grads = [r for r in rep.rows if r[0] == "gradient"]
    others = [r for r in rep.rows if r[0] not in ("gradient", "train lr", "train loss", "train grad norm")]
    if grads:
        rep.print_table("gradients (max|keel - torch| / max|torch grad| per tensor)", grads)

    def worst(check):
        rows = [r for r in rep.rows if r[0] == check]
        if not rows:
            return []
        bad = [r for r in rows if not r[4]]
        w = max(rows, key=lambda r: (not r[4], r[2] if math.isfinite(r[2]) else math.inf))
        return [(w[0], f"worst of {len(rows)}: {w[1]}", w[2], w[3], not bad,
                 f"{len(bad)} failing" if bad else w[5])]

    summary = others + worst("gradient") + worst("train loss") + worst("train grad norm") + worst("train lr")
    rep.print_table(f"summary ({args.config})", summary)
    failed = [r for r in rep.rows if not r[4]]
    if failed:
        print(f"\nFAIL: {len(failed)} of {len(rep.rows)} checks failed:")
        for r in failed[:20]:
            print(f"  {r[0]} {r[1]}: error {r[2]:.3e} > {r[3]:.1e} {r[5]}")
        return 1
    print(f"\nPASS: all {len(rep.rows)} checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
