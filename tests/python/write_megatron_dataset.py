#!/usr/bin/python3
"""Writes a Megatron-LM indexed dataset with no keel code, as Megatron-LM's
IndexedDatasetBuilder (megatron/core/datasets/indexed_dataset.py) lays it out.

    write_megatron_dataset.py PREFIX DTYPE DOCUMENTS VOCAB SEED

PREFIX.bin holds the documents' tokens back to back, each document ending
with the end-of-document token VOCAB - 1 (as preprocess_data.py --append-eod
leaves it); PREFIX.idx holds b"MMIDIDX\\x00\\x00", version 1 (uint64), the
dtype code (uint8: 8 for uint16, 4 for int32), the sequence count and the
document count (uint64; one sequence a document, and the document index
has a closing entry), then the sequence lengths (int32), their byte offsets
(int64) and the document index (int64). Prints {"tokens": [...]}, the stream
keel should read.
"""
import json
import struct
import sys

import numpy as np

CODES = {"uint16": (8, np.uint16), "int32": (4, np.int32)}


def main():
    prefix, dtype, documents, vocab, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    code, np_dtype = CODES[dtype]
    rng = np.random.default_rng(seed)
    eod = vocab - 1
    docs = [np.append(rng.integers(0, eod, size=int(rng.integers(1, 60))), eod).astype(np_dtype)
            for _ in range(documents)]
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(d.tobytes(order="C"))
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(np_dtype).itemsize)]).astype(np.int64)
    document_index = np.arange(documents + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_index)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(document_index.tobytes(order="C"))
    print(json.dumps({"tokens": [int(t) for d in docs for t in d]}))


if __name__ == "__main__":
    main()
