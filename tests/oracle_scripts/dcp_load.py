# Runs INSIDE the PyTorch venv (scripts/torch_env.sh), started by tests/torch_oracle.py: loads DCP
# checkpoints with torch.distributed.checkpoint.load, the oracle for what reshard reads and writes.
#
# argv[1] is JSON {"loads": [{"folder": DCP folder, "out": path prefix}]}. For each folder it writes
# <out>.npz (every tensor whole; bf16 as int16 and fp8 as uint8 bit patterns) and <out>.json (the
# non-tensor values, as JSON where they are, else their repr).
#   * alone (python dcp_load.py ...): one process loads the whole state dict (torch's
#     _EmptyStateDictLoadPlanner, as dcp_to_torch_save does);
#   * under torchrun --nproc_per_node N (gloo): every tensor of one dimension or more is loaded
#     into a Shard(0) DTensor over N ranks (0-d ones Replicate), so DCP reshards the saved chunks
#     into another world size; the shards are then gathered and rank 0 writes the files.

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def to_numpy(tensor):
    if isinstance(tensor, DTensor):  # gathered as fp32 (exact): gloo has no bf16 / fp8
        dtype = tensor.dtype
        local = tensor.to_local().contiguous()
        local = local.to(torch.float32) if dtype in BITS else local
        tensor = (
            DTensor.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
            .full_tensor()
            .to(dtype)
        )
    tensor = tensor.detach().contiguous()
    return (tensor.view(BITS[tensor.dtype]) if tensor.dtype in BITS else tensor).numpy()


def plain(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def flat(state, prefix=""):
    for key, value in state.items():
        if isinstance(value, dict):
            yield from flat(value, f"{prefix}{key}.")
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
            yield from flat({str(k): v for k, v in enumerate(value)}, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def load_whole(folder):
    state = {}
    reader = dcp.FileSystemReader(folder)
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return dict(flat(state))


def load_sharded(folder, mesh):
    metadata = dcp.FileSystemReader(folder).read_metadata()
    state = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            empty = torch.zeros(entry.size, dtype=entry.properties.dtype)
            placement = [Shard(0)] if len(entry.size) else [Replicate()]
            state[fqn] = distribute_tensor(empty.to(torch.float32), mesh, placement)
            state[fqn] = DTensor.from_local(
                state[fqn].to_local().to(entry.properties.dtype),
                mesh,
                placement,
                run_check=False,
                shape=entry.size,
                stride=empty.stride(),
            )
        else:
            state[fqn] = None
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
        state = load_sharded(job["folder"], mesh) if distributed else load_whole(job["folder"])
        tensors = {k: to_numpy(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
        values = {k: plain(v) for k, v in state.items() if not isinstance(v, torch.Tensor)}
        if not distributed or dist.get_rank() == 0:
            np.savez(job["out"] + ".npz", **tensors)
            with open(job["out"] + ".json", "w") as fh:
                json.dump(values, fh)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
