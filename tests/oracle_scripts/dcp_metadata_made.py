# Runs INSIDE the PyTorch venv (scripts/torch_env.sh), started by tests/torch_oracle.py: pickles the
# .metadata of a Shard(0) / FSDP save of "params" parameters on "ranks" ranks with torch's own classes,
# its objects shared as a save on that many processes shares them (each rank's plan and write results
# reach the coordinator pickled by gather_object: a tensor's name written out again in each rank's
# storage entries, a data file's name once per rank), in each of the pickle protocols asked for.
#
# argv[1] is JSON {"folder": prefix, "params": P, "ranks": R, "rows": rows per rank, "protocols": [..]}:
# writes <prefix>-p<protocol>/.metadata for each, and sparse __<r>_0.distcp files of the right sizes.

import json
import os
import pickle
import sys

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

COLUMNS = 8


def gathered(value):
    return pickle.loads(pickle.dumps(value))


def main():
    args = json.loads(sys.argv[1])
    params, ranks, rows = args["params"], args["ranks"], args["rows"]
    length = rows * COLUMNS * 4 + 1200
    entries, storage = {}, {}
    for r in range(ranks):
        plan = gathered(
            [
                (f"layers.{p}.weight", ChunkStorageMetadata(torch.Size([r * rows, 0]), torch.Size([rows, COLUMNS])))
                for p in range(params)
            ]
        )
        for fqn, chunk in plan:
            if fqn not in entries:
                props = TensorProperties(dtype=torch.bfloat16 if "3" in fqn else torch.float32)
                entries[fqn] = TensorStorageMetadata(props, torch.Size([rows * ranks, COLUMNS]), [])
            entries[fqn].chunks.append(chunk)
    for r in range(ranks):
        path = f"__{r}_0.distcp"
        offsets = torch.Size([r * rows, 0])
        storage.update(
            gathered(
                [
                    (MetadataIndex(f"layers.{p}.weight", offsets, r), _StorageInfo(path, p * length, length))
                    for p in range(params)
                ]
            )
        )
    metadata = Metadata(entries, planner_data={k: (k,) for k in entries}, storage_data=storage)
    for protocol in args["protocols"]:
        folder = f"{args['folder']}-p{protocol}"
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, ".metadata"), "wb") as fh:
            pickle.dump(metadata, fh, protocol=protocol)
        for r in range(ranks):
            with open(os.path.join(folder, f"__{r}_0.distcp"), "wb") as fh:
                fh.truncate(params * length)


if __name__ == "__main__":
    main()
