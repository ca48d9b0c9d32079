"""The harness the reference models' self-checks share (test_torch_gpt.py,
test_torch_llama.py): a registry of checks, float64 comparisons, non-trivial
parameters, and a main that runs every check and exits 1 if any failed.

A missing torch or numpy is a failure, not a skip: the references are what
keel's trainer is held to.
"""
import sys
import traceback

try:
    import torch
except Exception as e:  # must fail, not skip
    print(f"FAIL: cannot import torch with {sys.executable}: {e!r}")
    sys.exit(1)

torch.set_default_dtype(torch.float64)

CHECKS = []


def check(fn):
    """Registers `fn` (no arguments; returns a line to print) as a check."""
    CHECKS.append(fn)
    return fn


def close(a, b, tol, what):
    """The largest absolute difference of `a` and `b`; raises if over `tol`."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    if not err <= tol:
        raise AssertionError(f"{what}: max abs error {err:.3e} > {tol:.1e}")
    return err


def rand_params(model, seed, is_norm_weight, std=0.3):
    """Non-trivial parameters, norm weights around 1, so that every code path
    matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
            if is_norm_weight(name):
                p.add_(1.0)


def refuses(load, model, bad_sets):
    """Raises unless load(model, arrays) raises ValueError for every set of arrays."""
    for bad in bad_sets:
        try:
            load(model, bad)
        except ValueError:
            continue
        raise AssertionError("loader accepted a bad parameter set")


def main():
    """Runs every registered check; 0 when all passed, else 1."""
    failed = 0
    width = max((len(fn.__name__) for fn in CHECKS), default=0) + 2
    for fn in CHECKS:
        try:
            msg = fn()
            print(f"PASS  {fn.__name__:{width}s} {msg}")
        except Exception:
            failed += 1
            print(f"FAIL  {fn.__name__}")
            traceback.print_exc()
    print(f"{len(CHECKS) - failed}/{len(CHECKS)} checks passed (torch {torch.__version__})")
    return 1 if failed else 0
