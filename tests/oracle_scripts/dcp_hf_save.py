# Runs INSIDE the PyTorch venv under torchrun (gloo, CPU), started by tests/torch_oracle.py and
# bench/dcp_bench.py: saves a state dict of Shard(0) DTensors twice, as torch saves a sharded model.
#
# argv[1] is JSON {"tensors": n, "rows": r, "cols": c, "dtype": "float32"|"bfloat16", and any of
# "torch_save": folder (FileSystemWriter, the torch_save serialization: .metadata + __<r>_0.distcp),
# "hf": folder (HuggingFaceStorageWriter(save_distributed=True): shard-<r>-model-00001-of-00001
# .safetensors, the chunk offsets in each header's DCP_SHARDING_INFO, no .metadata),
# "consolidated": folder (rank 0 then runs torch's consolidate_safetensors_files on "hf" into it),
# "npz": path (rank 0 writes every tensor whole, bf16 as int16 bit patterns)}.
# Tensor i is layers.<i>.weight of (rows + i % 3, cols): uneven Shard(0) chunks when rows + i % 3 is odd.

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def main():
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    dtype = getattr(torch, args.get("dtype", "float32"))
    whole = {
        f"layers.{i}.weight": torch.randn(args["rows"] + i % 3, args["cols"]).to(dtype) for i in range(args["tensors"])
    }
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in whole.items()}
    if "torch_save" in args:
        dcp.save(state, storage_writer=FileSystemWriter(args["torch_save"]))
    if "hf" in args:
        mapping = dict.fromkeys(state, 1)
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(args["hf"], mapping, save_distributed=True))
    dist.barrier()
    if dist.get_rank() == 0:
        if "consolidated" in args:
            os.makedirs(args["consolidated"], exist_ok=True)
            consolidate_safetensors_files(args["hf"], args["consolidated"], dict.fromkeys(state, 1))
        if "npz" in args:
            bits = {k: (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy() for k, v in whole.items()}
            np.savez(args["npz"], **bits)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
