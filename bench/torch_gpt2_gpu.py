#!/usr/bin/env python3
"""GPT-2 124M on one GPU in PyTorch, the way nanoGPT trains it: the reference
keel's GPU step is measured against (scripts/gpu-check, bench/README.md).

Same shape, batch and precision as gpu-check's keel run: L12 C768 H12 T1024,
vocabulary 50257 padded to 50304, tied embedding, tanh GELU, batch 8, bf16
autocast over float32 master weights, fused AdamW (betas 0.9/0.95, decay 0.1
on 2-D weights), gradient clip 1.0, random tokens. Attention is
F.scaled_dot_product_attention (causal), so torch picks its flash or cuDNN
kernel. `--mode eager`, `compile` (torch.compile of the model) or `both`.

With `--dcp DIR` it also saves the model and optimizer state of the eager
run with torch.distributed.checkpoint.async_save (a single-process group):
the stall (until async_save returns and training may go on), the time until
the save is on disk, and a dcp.load of it, with the bytes written.

It first times causal F.scaled_dot_product_attention alone, forward +
backward at the model's attention shape (keel-bench-attention's twin).

Prints one JSON object per mode, one for attention and one for DCP on
stdout; progress on stderr.

    python3 bench/torch_gpt2_gpu.py [--mode both] [--steps 60] [--warmup 10] [--dcp DIR]
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, PADDED_VOCAB = 50257, 50304
N_LAYER, N_EMBD, N_HEAD, SEQ = 12, 768, 12, 1024
# H100 and H200 SXM dense bf16 peak, as gpu-check counts MFU.
PEAK_BF16 = 989.4e12


def log(msg):
    print(f"[torch_gpt2_gpu] {msg}", file=sys.stderr, flush=True)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.mlp_proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(PADDED_VOCAB, N_EMBD)
        self.wpe = nn.Embedding(SEQ, N_EMBD)
        self.h = nn.ModuleList([Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, PADDED_VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as keel's
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * N_LAYER) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB).float(), targets.reshape(-1))


def flops_per_token(model):
    """6 per parameter plus attention's 12 * L * C * T, as gpu-check and llm.c count."""
    params = sum(p.numel() for p in model.parameters())
    return 6 * params + 12 * N_LAYER * N_EMBD * SEQ


def make_optimizer(model, lr=6e-4):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def run(mode, args, device):
    torch.manual_seed(0)
    model = GPT().to(device)
    optimizer = make_optimizer(model)
    step_fn = torch.compile(model) if mode == "compile" else model
    gen = torch.Generator(device=device).manual_seed(1)
    torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (args.batch, SEQ + 1), device=device, generator=gen)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = step_fn(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step % 10 == 0:
            log(f"{mode} step {step}: loss {losses[-1]:.4f}, {1e3 * times[-1]:.1f} ms")
    timed = times[args.warmup:]
    step_s = statistics.median(timed)
    # Each step waits for the host (the batch, the loss read back), so its
    # time wanders with the host's load; the fastest tenth says what torch
    # does when the host keeps up.
    fast_s = sorted(timed)[len(timed) // 10]
    tokens_per_s = args.batch * SEQ / step_s
    result = {
        "bench": "torch_gpt2_gpu", "mode": mode, "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(device),
        "batch": args.batch, "seq_len": SEQ, "steps_timed": len(timed),
        "median_step_ms": 1e3 * step_s, "tokens_per_s": tokens_per_s,
        "fastest_tenth_step_ms": 1e3 * fast_s, "fastest_tenth_tokens_per_s": args.batch * SEQ / fast_s,
        "mfu": tokens_per_s * flops_per_token(model) / PEAK_BF16,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device),
        "first_loss": losses[0], "last_loss": losses[-1],
    }
    return result, model, optimizer


def measure_dcp(model, optimizer, directory):
    """async_save of the model and optimizer state, then dcp.load of it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.makedirs(directory, exist_ok=True)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(directory, 'pg')}", rank=0, world_size=1)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    target = os.path.join(directory, "step")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=target)
    stall_s = time.perf_counter() - t0
    future.result()
    save_s = time.perf_counter() - t0
    written = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(target) for f in files)
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=target)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    return {"bench": "torch_dcp", "torch_version": torch.__version__, "state_bytes_written": written,
            "async_save_stall_s": stall_s, "async_save_total_s": save_s,
            "save_bytes_per_s": written / save_s, "load_s": load_s, "load_bytes_per_s": written / load_s}


def measure_attention(device, batch, iterations=20):
    """Causal SDPA forward + backward at the model's attention shape, bf16,
    FLOPs counted as keel-bench-attention counts them."""
    heads, d = N_HEAD, N_EMBD // N_HEAD
    gen = torch.Generator(device=device).manual_seed(2)
    q, k, v = (torch.rand(batch, heads, SEQ, d, device=device, dtype=torch.bfloat16, generator=gen,
                          requires_grad=True) for _ in range(3))
    dout = torch.rand(batch, heads, SEQ, d, device=device, dtype=torch.bfloat16, generator=gen)
    start, forwarded, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    forward_ms = backward_ms = 0.0
    for i in range(3 + iterations):
        start.record()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        forwarded.record()
        out.backward(dout)
        done.record()
        done.synchronize()
        if i >= 3:
            forward_ms += start.elapsed_time(forwarded) / iterations
            backward_ms += forwarded.elapsed_time(done) / iterations
    flops = 4.0 * batch * heads * SEQ * SEQ * d / 2.0
    return {"bench": "torch_attention", "torch_version": torch.__version__,
            "shape": {"batch": batch, "heads": heads, "seq_len": SEQ, "head_dim": d},
            "forward_ms": forward_ms, "backward_ms": backward_ms,
            "forward_tflops": flops / (forward_ms * 1e-3) / 1e12,
            "backward_tflops": 2.5 * flops / (backward_ms * 1e-3) / 1e12,
            "tflops": 3.5 * flops / ((forward_ms + backward_ms) * 1e-3) / 1e12}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["eager", "compile", "both"], default="both")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10, help="first steps left out of the timing (compilation)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dcp", metavar="DIR", help="also measure DCP async_save and load of the eager run's state")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if not torch.cuda.is_available():
        log("no CUDA device: this benchmark measures the GPU")
        return 1
    device = torch.device("cuda", 0)
    print(json.dumps(measure_attention(device, args.batch)), flush=True)
    modes = ["eager", "compile"] if args.mode == "both" else [args.mode]
    for mode in modes:
        result, model, optimizer = run(mode, args, device)
        print(json.dumps(result), flush=True)
        if mode == "eager" and args.dcp:
            print(json.dumps(measure_dcp(model, optimizer, args.dcp)), flush=True)
        del model, optimizer
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
