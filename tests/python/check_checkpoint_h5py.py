#!/usr/bin/env python3
"""Reads a keel checkpoint with h5py alone (docs/architecture.md "Checkpoints" interoperability).

Every global tensor of index.h5 (a virtual dataset) must equal the tensor
assembled from the rank files' pieces by their attributes (global_name,
global_shape, offset), every element covered exactly once. Prints one JSON
object; exits 1 on any mismatch.

    check_checkpoint_h5py.py CHECKPOINT_DIR
"""
import json
import os
import sys

import h5py
import numpy as np


def main():
    ckpt = sys.argv[1]
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    assembled, covered = {}, {}
    for entry in manifest["files"]:
        if entry["name"] == "index.h5":
            continue
        with h5py.File(os.path.join(ckpt, entry["name"]), "r") as rank_file:
            def take(name, obj):
                if not isinstance(obj, h5py.Dataset):
                    return
                tensor = name.rsplit("@", 1)[0]
                shape = tuple(int(d) for d in obj.attrs["global_shape"])
                offset = tuple(int(o) for o in obj.attrs["offset"])
                whole = assembled.setdefault(tensor, np.full(shape, np.nan, np.float32))
                hits = covered.setdefault(tensor, np.zeros(shape, np.int32))
                block = tuple(slice(o, o + n) for o, n in zip(offset, obj.shape))
                whole[block] = obj[...]
                hits[block] += 1
            rank_file.visititems(take)

    problems, tensors = [], []
    with h5py.File(os.path.join(ckpt, "index.h5"), "r") as index:
        index.visititems(lambda name, obj: tensors.append(name)
                         if isinstance(obj, h5py.Dataset) else None)
        for name in tensors:
            virtual = index[name][...]
            if name not in assembled:
                problems.append(f"{name}: in index.h5 but in no rank file")
            elif not (covered[name] == 1).all():
                problems.append(f"{name}: {(covered[name] != 1).sum()} elements not covered exactly once")
            elif not np.array_equal(virtual, assembled[name]):
                problems.append(f"{name}: index.h5 differs from the rank files' pieces")
    problems += [f"{name}: in the rank files but not in index.h5" for name in sorted(set(assembled) - set(tensors))]
    print(json.dumps({"tensors": len(tensors), "elements": int(sum(a.size for a in assembled.values())),
                      "problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
