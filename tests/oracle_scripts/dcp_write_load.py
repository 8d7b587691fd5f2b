# Runs INSIDE the PyTorch venv (scripts/torch_env.sh), started by tests/test_dcp_write_oracle.py: loads the
# DCP checkpoints reshard wrote with torch.distributed.checkpoint.load, into another world size and sharding.
#
# argv[1] is JSON {"loads": [{"folder": DCP folder, "out": path prefix, "dim": 0 or 1}]}; writes <out>.npz
# (every tensor whole; bf16 as int16 bit patterns). Alone: one process loads the whole state dict. Under
# torchrun --nproc_per_node N (gloo): every tensor with more than "dim" dimensions is loaded into a
# Shard(dim) DTensor over N ranks (the others Replicate), then gathered; rank 0 writes the file.

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_load import load_whole, to_numpy
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def load_sharded(folder, mesh, dim):
    metadata = dcp.FileSystemReader(folder).read_metadata()
    state = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        empty = torch.zeros(entry.size, dtype=torch.float32)
        placement = [Shard(dim)] if len(entry.size) > dim else [Replicate()]
        local = distribute_tensor(empty, mesh, placement).to_local().to(entry.properties.dtype)
        state[fqn] = DTensor.from_local(
            local, mesh, placement, run_check=False, shape=entry.size, stride=empty.stride()
        )
    dcp.load(state, checkpoint_id=folder)
    return state


def main():
    args = json.loads(sys.argv[1])
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for job in args["loads"]:
        state = load_sharded(job["folder"], mesh, job.get("dim", 0)) if distributed else load_whole(job["folder"])
        tensors = {k: to_numpy(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
        if not distributed or dist.get_rank() == 0:
            np.savez(job["out"] + ".npz", **tensors)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
