#!/usr/bin/python3
"""Evaluates a Hugging Face model directory that keel exported, with no keel code.

    eval_hf_export.py EXPORT_DIR TOKEN_FILE SEQUENCES

An independent reader: the safetensors files are parsed by hand (the 8-byte
little-endian header length, the JSON header, the bytes read with numpy),
sharded ones through model.safetensors.index.json; config.json alone sets
up the model, a PyTorch model of Hugging Face's conventions (GPT2LMHeadModel
with its Conv1D weights stored [in, out]; LlamaForCausalLM), evaluated in
float64. Prints one JSON object {"loss", "sequences", "tokens", "tensors"}:
the mean cross-entropy over the first SEQUENCES non-overlapping windows of
seq_len + 1 tokens of TOKEN_FILE (an llm.c shard), as keel-trainer --eval
computes it.
"""
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402
import torch_llama  # noqa: E402

DTYPES = {"F32": np.float32, "BF16": np.uint16, "F16": np.float16}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    body = data[8 + n:]
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        raw = np.frombuffer(body[begin:end], dtype=DTYPES[entry["dtype"]])
        if entry["dtype"] == "BF16":  # the upper half of a float32
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.astype(np.float64).reshape(entry["shape"])
    return out


def read_weights(export):
    index = os.path.join(export, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(export, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    weights = {}
    for file in sorted(set(weight_map.values())):
        part = read_safetensors(os.path.join(export, file))
        for name in part:
            if weight_map.get(name) != file:
                raise ValueError(f"{file} holds {name}, which the index places in {weight_map.get(name)}")
        weights.update(part)
    if set(weights) != set(weight_map):
        raise ValueError(f"the index and the files disagree: {sorted(set(weights) ^ set(weight_map))}")
    return weights


def gpt2_model(config, weights):
    """GPT2LMHeadModel's tensors into the PyTorch GPT (nanoGPT names, [out, in])."""
    if config["activation_function"] != "gelu_new" or config["layer_norm_epsilon"] != 1e-5:
        raise ValueError("the reference GPT computes tanh GELU and LayerNorm eps 1e-5")
    if not config.get("tie_word_embeddings", True):
        raise ValueError("the reference GPT ties its head")
    C = config["n_embd"]
    if config.get("n_inner") not in (None, 4 * C):
        raise ValueError("the reference GPT's MLP is 4 n_embd wide")
    cfg = torch_gpt.GPTConfig(vocab_size=config["vocab_size"], seq_len=config["n_positions"],
                              n_layer=config["n_layer"], n_head=config["n_head"], n_embd=C)
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    arrays = {}
    for name, value in weights.items():
        if not name.startswith("transformer."):
            raise ValueError(f"{name} is not a tensor of GPT2LMHeadModel with a tied head")
        ours = name[len("transformer."):]
        if ours in ("wte.weight", "wpe.weight"):
            ours = ours[:-len(".weight")]
        arrays[ours] = value.T if ours.endswith(conv1d) else value
    # The reference holds a padded vocabulary, whose rows never score.
    wte = np.zeros((cfg.padded_vocab, C))
    wte[:cfg.vocab_size] = arrays["wte"]
    arrays["wte"] = wte
    torch.set_default_dtype(torch.float64)
    model = torch_gpt.GPT(cfg)
    torch_gpt.load_numpy_params(model, arrays)
    return model, cfg.seq_len, lambda x, y: model(x, y)[1]


def llama_model(config, weights):
    cfg = torch_llama.LlamaConfig.from_hf(config)
    if config.get("head_dim", cfg.head_dim) != cfg.head_dim:
        raise ValueError("head_dim must be hidden_size / num_attention_heads")
    if config["hidden_act"] != "silu" or config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("the reference Llama computes SiLU with no biases")
    torch.set_default_dtype(torch.float64)
    model = torch_llama.Llama(cfg)
    torch_llama.load_numpy_params(model, weights)
    return model, cfg.seq_len, lambda x, y: model(x, y)[1]


def main():
    export, token_file, sequences = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(os.path.join(export, "config.json")) as f:
        config = json.load(f)
    weights = read_weights(export)
    build = {"gpt2": gpt2_model, "llama": llama_model}[config["model_type"]]
    model, T, loss_of = build(config, weights)
    tokens = torch_gpt.read_llmc_shard(token_file).astype(np.int64)
    windows = tokens[: sequences * (T + 1)].reshape(sequences, T + 1)
    with torch.no_grad():
        loss = loss_of(torch.from_numpy(windows[:, :T]), torch.from_numpy(windows[:, 1:]))
    print(json.dumps({"loss": float(loss), "sequences": sequences, "tokens": sequences * T,
                      "tensors": len(weights)}))


if __name__ == "__main__":
    main()
