#!/usr/bin/python3
"""Evaluates a keel checkpoint with PyTorch alone, as keel-trainer --eval does.

    eval_checkpoint_torch.py CHECKPOINT_DIR TOKEN_FILE SEQUENCES

Reads the model config from manifest.json and the weights from index.h5 with
h5py, rebuilds the model (torch_gpt.py, float64) and prints one JSON object
{"step", "loss", "sequences", "tokens"}: the mean cross-entropy over the first
SEQUENCES non-overlapping windows of seq_len + 1 tokens of TOKEN_FILE.
"""
import json
import os
import sys

import h5py
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt import GPT, GPTConfig, load_numpy_params, read_llmc_shard  # noqa: E402


def main():
    ckpt, token_file, sequences = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    cfg = GPTConfig.from_dict(manifest["config"]["model"])
    torch.set_default_dtype(torch.float64)
    model = GPT(cfg)
    arrays = {}
    with h5py.File(os.path.join(ckpt, "index.h5"), "r") as index:
        for name in index["model"]:
            arrays[name] = index["model"][name][...].astype(np.float64)
    load_numpy_params(model, arrays)
    T = cfg.seq_len
    tokens = read_llmc_shard(token_file).astype(np.int64)
    windows = tokens[: sequences * (T + 1)].reshape(sequences, T + 1)
    with torch.no_grad():
        _, loss, _ = model(torch.from_numpy(windows[:, :T]), torch.from_numpy(windows[:, 1:]))
    print(json.dumps({"step": manifest["step"], "loss": float(loss), "sequences": sequences,
                      "tokens": sequences * T}))


if __name__ == "__main__":
    main()
