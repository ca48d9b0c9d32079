#!/usr/bin/python3
"""CPU training throughput: keel vs PyTorch on the same models.

Trains each model of --models (default both) for S steps in keel
(build/bin/keel-trainer with a generated config and random-token shard, read
back from RUN_DIR/metrics.jsonl) and in PyTorch (float32), alternating keel
and torch runs for R rounds on the same machine with the same number of
threads and OpenBLAS kernels (torch runs on the core keel runs,
OPENBLAS_CORETYPE). The models (table MODELS), all L=4, C=256, H=4, T=256,
batch 8, V=256, fp32:

  gpt2   GPT-2 (model.arch "gpt2"), PyTorch: tests/python/torch_gpt.py's GPT.
  llama  Llama 3 (model.arch "llama": RMSNorm, rotary positions, SwiGLU, no
         biases) with n_kv_head=2 (grouped-query attention), ffn_hidden=688,
         rope_theta=10000 and an untied head; PyTorch:
         tests/python/torch_llama.py's Llama (Hugging Face conventions).

Both sides decay exactly the 2-D tensors (keel's ParamSpec::weight_decay).
The first --warmup steps of every run are discarded. Prints one JSON object
per run (with its "model") and a summary object (medians over runs) on
stdout; progress goes to stderr. The summary's "models" maps each model to
its figures; its top-level figures (keel_tokens_per_s, ratio, ...) are the
first model's of --models, GPT-2's by default, under the same names as
before.

PyTorch on Debian has two thread pools: its OpenMP intra-op pool
(torch.set_num_threads) and the pthreads pool of the OpenBLAS behind its
GEMMs (OPENBLAS_NUM_THREADS, fixed when the library loads). With N threads
allowed, each torch run is its own process with one split of the two pools
(N/N, the default; 1/N; N/1), and keel is compared with the best of them.

    /usr/bin/python3 bench/train_throughput.py [--keel-trainer PATH] [--threads N]
                                               [--rounds 3] [--steps 12] [--blas-cores auto]
                                               [--models gpt2,llama]

--blas-cores Prescott,auto runs keel under each train.blas_core in every round
and reports each one's tokens/s beside the GEMM ceiling measured on its
core (keel_by_blas_core).
"""
import argparse
import collections
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

try:
    import numpy as np
    import torch
except Exception as e:
    print(f"train_throughput: needs torch and numpy; {sys.executable} cannot import them: {e!r} "
          f"(use /usr/bin/python3)", file=sys.stderr)
    sys.exit(1)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
import torch_gpt as tg  # noqa: E402
import torch_llama as tl  # noqa: E402

SHAPE = dict(vocab_size=256, seq_len=256, n_layer=4, n_head=4, n_embd=256)
BATCH = 8
LR = 6e-4
WEIGHT_DECAY = 0.1
SEED = 1337
SHARD_TOKENS = 1 << 20
TARGET_RATIO = 1.2


class BenchLlama(tl.Llama):
    """torch_llama.Llama called like torch_gpt.GPT (tg.train_step wants (logits, loss, aux)); a dense
    model's aux loss is 0. Parameters and forward are torch_llama's own."""

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        return logits, loss, logits.new_zeros(())


def build_gpt2(keys):
    model = tg.GPT(tg.GPTConfig(**keys)).float()
    model.init_weights(seed=SEED)
    return model


def build_llama(keys):
    cfg = tl.LlamaConfig(vocab_size=keys["vocab_size"], seq_len=keys["seq_len"], n_layer=keys["n_layer"],
                         n_head=keys["n_head"], n_kv_head=keys["n_kv_head"], n_embd=keys["n_embd"],
                         ffn_hidden=keys["ffn_hidden"], rope_theta=keys["rope_theta"], norm_eps=keys["norm_eps"],
                         tie_embeddings=keys["tie_embeddings"])
    model = BenchLlama(cfg).float()
    model.init_weights(seed=SEED)
    return model


def keel_decay_groups(model):
    """AdamW groups as keel's: weight decay on exactly the 2-D tensors (ParamSpec::weight_decay in
    trainer/params/parameters.h), none on the rest (biases, LayerNorm and RMSNorm weights). For these
    dense models it is tg.make_optimizer's rule (dim >= 2): they have no tensor of more dimensions."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() == 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0}]


# name -> keel's [model] keys (in config order), the PyTorch model built from them, its AdamW groups.
MODELS = {
    "gpt2": dict(keel=dict(SHAPE, n_expert=0), torch=build_gpt2, param_groups=keel_decay_groups),
    "llama": dict(keel=dict(arch="llama", **SHAPE, n_kv_head=2, ffn_hidden=688, rope_theta=10000.0,
                            norm_eps=1e-5, tie_embeddings=False, n_expert=0),
                  torch=build_llama, param_groups=keel_decay_groups),
}


def log(msg):
    print(f"[train_throughput] {msg}", file=sys.stderr, flush=True)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)  # 10000.0, 1e-05: TOML floats
    if isinstance(v, int):
        return str(v)
    return json.dumps(v)


def keel_config(path, model, shard, run_dir, steps, threads, blas_core="auto"):
    model_keys = "\n".join(f"{k} = {toml_value(v)}" for k, v in MODELS[model]["keel"].items())
    text = f"""# generated by bench/train_throughput.py (model {model})
[job]
name = "bench-train-throughput"
run_dir = {json.dumps(run_dir)}
seed = {SEED}

[model]
{model_keys}

[data]
train = {json.dumps(shard)}

[parallel]
micro_batches = 1

[train]
steps = {steps}
batch_size = {BATCH}
lr = {LR}
warmup_steps = 1
weight_decay = {WEIGHT_DECAY}
grad_clip = 1.0
val_every = 0
log_every = {steps}
threads = {threads}
blas_core = {json.dumps(blas_core)}
"""
    with open(path, "w") as f:
        f.write(text)


def blas_report(args, tmp, model, shard, blas_core):
    """keel-trainer --blas-report: the BLAS core keel runs under `blas_core` and the GEMM ceiling measured on it
    (a fixed 1024^3 GEMM: the model only has to give a valid config)."""
    cfg = os.path.join(tmp, f"blas_{blas_core}.toml")
    keel_config(cfg, model, shard, os.path.join(tmp, "blas_run"), args.steps, args.threads, blas_core)
    proc = subprocess.run([args.keel_trainer, "--config", cfg, "--blas-report"], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        log(f"keel-trainer --blas-report exited with status {proc.returncode} (train.blas_core = {blas_core})")
        sys.exit(1)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_keel(args, tmp, model, shard, rnd, blas_core):
    run_dir = os.path.join(tmp, f"keel_run_{model}_{rnd}_{blas_core}")
    cfg = os.path.join(tmp, f"keel_{model}_{rnd}_{blas_core}.toml")
    keel_config(cfg, model, shard, run_dir, args.steps, args.threads, blas_core)
    cmd = [args.keel_trainer, "--config", cfg]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        log(f"keel-trainer exited with status {proc.returncode}: {' '.join(cmd)}\n{proc.stdout}")
        sys.exit(1)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics_path):
        log(f"keel-trainer wrote no {metrics_path}; its output:\n{proc.stdout}")
        sys.exit(1)
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: r["step"])
    if len(rows) < args.steps:
        log(f"keel wrote {len(rows)} metric rows, expected {args.steps}")
        sys.exit(1)
    kept = rows[args.warmup:]
    step_s = [float(r["step_ms"]) / 1000.0 for r in kept]
    tokens = BATCH * MODELS[model]["keel"]["seq_len"] * len(kept)
    return {
        "run": "keel", "model": model, "round": rnd, "blas_core": blas_core, "steps_measured": len(kept),
        "tokens_per_s": tokens / sum(step_s),
        "median_step_ms": 1000.0 * statistics.median(step_s),
        "keel_reported_tokens_per_s": statistics.median(float(r["tokens_per_s"]) for r in kept),
        "first_loss": float(rows[0]["loss"]), "last_loss": float(rows[-1]["loss"]),
        "process_wall_s": wall,
    }


def torch_splits(threads):
    """(intra-op threads, OpenBLAS threads) for each torch run: the default
    first, then each pool alone at full width."""
    splits = [(threads, threads), (1, threads), (threads, 1)]
    return list(dict.fromkeys(splits))


def run_torch_process(args, model, shard, rnd, intra, blas, core):
    """One torch run in a child process, so its OpenBLAS pool has `blas` threads; `core`, when set, is the
    OpenBLAS core it runs (keel's, so that neither side is compared on kernels the other does not run)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", shard, "--worker-model", model,
           "--intra-threads", str(intra), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--round", str(rnd)]
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(blas))
    if core:
        env["OPENBLAS_CORETYPE"] = core
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          timeout=args.timeout)
    if proc.returncode != 0:
        log(f"torch run failed with status {proc.returncode}:\n{proc.stderr}")
        sys.exit(1)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(intra_threads=intra, blas_threads=blas, blas_core=core or "library")
    return result


def run_torch(args, name, tokens, rnd):
    torch.set_num_threads(args.intra_threads)
    torch.manual_seed(SEED + rnd)
    spec = MODELS[name]
    model = spec["torch"](spec["keel"])
    model.train()
    groups = spec["param_groups"](model)
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(SEED + rnd)
    T = spec["keel"]["seq_len"]
    step_s, losses = [], []
    for s in range(args.steps):
        t0 = time.perf_counter()
        starts = rng.integers(0, len(tokens) - T - 1, BATCH)
        batch = np.stack([tokens[i:i + T + 1] for i in starts]).astype(np.int64)
        x = torch.from_numpy(batch[:, :-1])
        y = torch.from_numpy(batch[:, 1:])
        lr = tg.lr_schedule(s, LR, 1, args.steps, 0.1)
        loss, _ = tg.train_step(model, opt, x, y, micro_batches=1, grad_clip=1.0, lr=lr)
        step_s.append(time.perf_counter() - t0)
        losses.append(loss)
    kept = step_s[args.warmup:]
    return {
        "run": "torch", "model": name, "round": rnd, "steps_measured": len(kept),
        "tokens_per_s": BATCH * T * len(kept) / sum(kept),
        "median_step_ms": 1000.0 * statistics.median(kept),
        "first_loss": losses[0], "last_loss": losses[-1],
        "params": sum(p.numel() for p in model.parameters()),
        "params_decayed": sum(p.numel() for p in groups[0]["params"]),
    }


def median_tps(rs):
    return statistics.median(r["tokens_per_s"] for r in rs) if rs else None


def model_summary(name, results, blas_cores, blas_reports, threads):
    """One model's figures (medians over its runs): keel's under each BLAS core, torch's by thread split, and
    keel over the best torch split (ratio) and over torch's default split."""
    keys = MODELS[name]["keel"]
    runs = results[name]
    keel_tps = median_tps(runs.get(f"keel_{blas_cores[0]}"))
    keel_by_blas_core = {b: {"tokens_per_s": median_tps(runs.get(f"keel_{b}")), "blas": report["blas"],
                             "gemm_gflops": report["gemm"]["gflops"]} for b, report in blas_reports.items()}
    torch_by_split = {key[len("torch_"):]: median_tps(rs) for key, rs in runs.items() if key.startswith("torch_")}
    best_split = max(torch_by_split, key=torch_by_split.get) if torch_by_split else None
    torch_tps = torch_by_split.get(best_split)
    default_tps = torch_by_split.get(f"{threads}x{threads}")
    shape = {k: keys[k] for k in ("n_layer", "n_embd", "n_head", "seq_len")}
    extra = {k: v for k, v in keys.items() if k not in SHAPE and k not in ("arch", "n_expert")}
    return {
        "model": {"arch": keys.get("arch", "gpt2"), **shape, "batch_size": BATCH, "vocab_size": keys["vocab_size"],
                  **extra, "dtype": "fp32"},
        "keel_tokens_per_s": keel_tps,
        "keel_by_blas_core": keel_by_blas_core,
        "torch_tokens_per_s": torch_tps,
        "torch_best_split": best_split,
        "torch_tokens_per_s_by_split": torch_by_split,
        "ratio": keel_tps / torch_tps if keel_tps and torch_tps else None,
        "ratio_vs_torch_default_threads": keel_tps / default_tps if keel_tps and default_tps else None,
        "target_ratio": TARGET_RATIO,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keel-trainer", default=os.path.join(REPO, "build", "bin", "keel-trainer"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3, help="keel/torch run pairs, alternating")
    ap.add_argument("--steps", type=int, default=12, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the timing")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated models to measure, each every round (of {', '.join(MODELS)}; default "
                         f"all); the first one's figures are the summary's top-level ones")
    ap.add_argument("--only", choices=["keel", "torch"], help="run one side only (ratio is then null)")
    ap.add_argument("--blas-cores", default="auto",
                    help="comma-separated train.blas_core settings keel runs under, each every round (e.g. "
                         "Prescott,auto: the generic kernels against the CPU's own); the first is the one compared "
                         "with torch")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one keel run may take")
    ap.add_argument("--require-target", action="store_true",
                    help="exit 1 when keel/torch of any model measured is below the target ratio")
    ap.add_argument("--torch-worker", metavar="SHARD", help=argparse.SUPPRESS)
    ap.add_argument("--worker-model", default="gpt2", choices=list(MODELS), help=argparse.SUPPRESS)
    ap.add_argument("--intra-threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_worker:
        tokens = np.fromfile(args.torch_worker, dtype=np.uint16, offset=256 * 4)
        print(json.dumps(run_torch(args, args.worker_model, tokens, args.round)), flush=True)
        return 0
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.threads < 1 or args.rounds < 1:
        ap.error("--threads and --rounds must be at least 1")
    models = list(dict.fromkeys(m.strip() for m in args.models.split(",") if m.strip()))
    unknown = [m for m in models if m not in MODELS]
    if not models or unknown:
        ap.error(f"--models takes a comma-separated list of {', '.join(MODELS)} (got {args.models!r})")
    vocab = {MODELS[m]["keel"]["vocab_size"] for m in models}
    assert len(vocab) == 1, "the models share one random-token shard, so they need one vocab_size"
    run_keel_side = args.only != "torch"
    run_torch_side = args.only != "keel"
    if run_keel_side and not os.access(args.keel_trainer, os.X_OK):
        log(f"keel trainer not found or not executable: {args.keel_trainer} (build it, or pass --keel-trainer)")
        return 1

    blas_cores = [b for b in args.blas_cores.split(",") if b]
    if not blas_cores:
        ap.error("--blas-cores needs at least one setting")
    results = {m: collections.defaultdict(list) for m in models}  # model -> run key -> runs
    blas_reports = {}
    with tempfile.TemporaryDirectory(prefix="keel-bench-") as tmp:
        shard = os.path.join(tmp, "train_000000.bin")
        rng = np.random.default_rng(SEED)
        tokens = rng.integers(0, vocab.pop(), SHARD_TOKENS).astype(np.uint16)
        tg.write_llmc_shard(shard, tokens)
        if run_keel_side:
            for blas_core in blas_cores:
                blas_reports[blas_core] = blas_report(args, tmp, models[0], shard, blas_core)
                log(f"train.blas_core = {blas_core}: {json.dumps(blas_reports[blas_core])}")
        blas_report_of_first = blas_reports.get(blas_cores[0])
        for rnd in range(args.rounds):
            for model in models:
                # alternate which side goes first so drift does not favour either
                order = ["keel", "torch"] if rnd % 2 == 0 else ["torch", "keel"]
                for side in order:
                    if side == "keel" and run_keel_side:
                        for blas_core in blas_cores:
                            log(f"round {rnd}: {model}: keel, {args.steps} steps, {args.threads} threads, "
                                f"train.blas_core = {blas_core}")
                            r = run_keel(args, tmp, model, shard, rnd, blas_core)
                            r["threads"] = args.threads
                            results[model][f"keel_{blas_core}"].append(r)
                            print(json.dumps(r), flush=True)
                    elif side == "torch" and run_torch_side:
                        for intra, blas in torch_splits(args.threads):
                            log(f"round {rnd}: {model}: torch, {args.steps} steps, {intra} intra-op x {blas} "
                                f"OpenBLAS threads")
                            core = blas_report_of_first["blas"]["core"] if blas_report_of_first else None
                            r = run_torch_process(args, model, shard, rnd, intra, blas, core)
                            r["threads"] = args.threads
                            results[model][f"torch_{intra}x{blas}"].append(r)
                            print(json.dumps(r), flush=True)

    per_model = {m: model_summary(m, results, blas_cores, blas_reports, args.threads) for m in models}
    first = per_model[models[0]]
    summary = {
        "bench": "train_throughput",
        # the first model's figures, top level as before the table of models (GPT-2's by default)
        "model": first["model"],
        "threads": args.threads,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup_steps_discarded": args.warmup,
        "keel_tokens_per_s": first["keel_tokens_per_s"],
        "blas": blas_reports.get(blas_cores[0]),
        "keel_by_blas_core": first["keel_by_blas_core"],
        "torch_tokens_per_s": first["torch_tokens_per_s"],
        "torch_best_split": first["torch_best_split"],
        "torch_tokens_per_s_by_split": first["torch_tokens_per_s_by_split"],
        "ratio": first["ratio"],
        "ratio_vs_torch_default_threads": first["ratio_vs_torch_default_threads"],
        "target_ratio": TARGET_RATIO,
        "models": per_model,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "torch_version": torch.__version__,
    }
    print(json.dumps(summary), flush=True)
    if args.require_target:
        below = {m: s["ratio"] for m, s in per_model.items()
                 if s["ratio"] is None or not math.isfinite(s["ratio"]) or s["ratio"] < TARGET_RATIO}
        if below:
            log(f"keel/torch below the target {TARGET_RATIO}: {json.dumps(below)}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
