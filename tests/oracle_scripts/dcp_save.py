# Runs INSIDE the PyTorch venv (scripts/torch_env.sh) under `torchrun --nproc_per_node 2` (gloo, CPU),
# started by tests/torch_oracle.py: saves real DCP checkpoints with torch.distributed.checkpoint.save.
#
# argv[1] is JSON {"root": folder}. Under the root, rank 0 writes one folder per checkpoint and, beside
# each, <name>.npz with the full tensors the ranks saved (bf16 and fp8 as their unsigned bit
# patterns: numpy here has no such dtypes) and <name>.json with the non-tensor values.
#   dtensor      DTensors on a 1-D CPU mesh: Shard(0) uneven (7 rows on 2 ranks), Shard(1) bf16,
#                Shard(0) of 1 row (rank 1 holds an empty shard), Replicate int64, a plain fp16
#                tensor, a 0-d fp32 DTensor, fp8; an int step and a nested dict (non-tensor values).
#   dtensor_st   the same state dict in the SAFETENSORS serialization.
#   fsdp2        a tiny model under FSDP2's fully_shard and its Adam state after one step, as
#                torch.distributed.checkpoint.state_dict.get_state_dict gives them.
#   megatron     megatron-core's dist_checkpointing.save of hand-built ShardedTensors (torch_dist:
#                the DCP files plus metadata.json and common.pt): split, replicated, a stacked axis.

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def full_numpy(value):
    """A saved tensor whole, as numpy (bf16 / fp8 as their bit patterns)."""
    if isinstance(value, DTensor):  # gathered as fp32 (exact): gloo has no bf16 / fp8
        dtype = value.dtype
        local = value.to_local().contiguous()
        local = local.to(torch.float32) if dtype in BITS else local
        value = (
            DTensor.from_local(
                local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
            .full_tensor()
            .to(dtype)
        )
    tensor = value.detach().cpu().contiguous()
    return (tensor.view(BITS[tensor.dtype]) if tensor.dtype in BITS else tensor).numpy()


def flat(state, prefix=""):
    """DCP's flattening of nested dicts: "a.b" keys."""
    for key, value in state.items():
        if isinstance(value, dict) and not (prefix == "" and key == "extra"):
            yield from flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def record(root, name, state):
    tensors = {}
    values = {}
    for key, value in flat(state):
        if isinstance(value, torch.Tensor):
            tensors[key] = full_numpy(value)
        elif isinstance(value, dict):
            for sub, item in value.items():
                values[f"{key}.{sub}"] = item
        else:
            values[key] = value
    if dist.get_rank() == 0:
        np.savez(os.path.join(root, f"{name}.npz"), **tensors)
        with open(os.path.join(root, f"{name}.json"), "w") as fh:
            json.dump(
                {"values": values, "dtypes": {k: str(v.dtype) for k, v in flat(state) if isinstance(v, torch.Tensor)}},
                fh,
            )


def shard_rows(tensor, mesh):
    """A Shard(0) DTensor made without communication (gloo cannot scatter fp8)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = -(-tensor.shape[0] // world)
    local = tensor[rank * rows : (rank + 1) * rows].contiguous()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=tensor.shape, stride=tensor.stride())


def dtensor_state(mesh):
    torch.manual_seed(0)
    return {
        "rows": distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)]),
        "cols_bf16": distribute_tensor(torch.randn(4, 6).to(torch.bfloat16), mesh, [Shard(1)]),
        "one_row": distribute_tensor(torch.randn(1, 3), mesh, [Shard(0)]),
        "ids": distribute_tensor(torch.arange(12, dtype=torch.int64).reshape(3, 4), mesh, [Replicate()]),
        "plain_fp16": torch.linspace(-2, 2, 6, dtype=torch.float16),
        "scalar": distribute_tensor(torch.tensor(2.5), mesh, [Replicate()]),
        "fp8": shard_rows(torch.randn(4, 8).to(torch.float8_e4m3fn), mesh),
        "step": 7,
        "extra": {"lr": 0.125, "names": ["a", "b"]},
    }


def fsdp2_state(mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 5)).sum().backward()
    optim.step()
    model_state, optim_state = get_state_dict(model, optim)
    return {"model": model_state, "optim": optim_state}


def megatron_save(folder):
    """Megatron-core's dist_checkpointing.save (torch_dist): DCP data plus metadata.json and common.pt.

    Its saver assumes CUDA in two places that do not touch the format; they are replaced first.
    """
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    qkv = torch.randn(8, 6)
    layers = torch.randn(2, 4, 6).to(torch.bfloat16)  # a stacked layer axis, split by "pipeline stage"
    state = {
        "qkv": ShardedTensor.from_rank_offsets(
            "decoder.layers.self_attention.linear_qkv.weight", qkv[rank * 4 : (rank + 1) * 4].clone(), (0, rank, world)
        ),
        "norm": ShardedTensor.from_rank_offsets("decoder.final_layernorm.weight", torch.ones(6) * 0.5, replica_id=rank),
        "stack": ShardedTensor.from_rank_offsets(
            "decoder.layers.mlp.linear_fc1.weight", layers[rank : rank + 1].clone(), (0, rank, world)
        ),
    }
    os.makedirs(folder, exist_ok=True)  # megatron saves into an existing, empty folder
    dist.barrier()
    dist_checkpointing.save(state, folder)
    if rank == 0:
        expected = {
            "decoder.layers.self_attention.linear_qkv.weight": qkv.numpy(),
            "decoder.final_layernorm.weight": (torch.ones(6) * 0.5).numpy(),
            "decoder.layers.mlp.linear_fc1.weight": layers.view(torch.int16).numpy(),
        }
        np.savez(folder + ".npz", **expected)


def main():
    args = json.loads(sys.argv[1])
    root = args["root"]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name, state, fmt in (
        ("dtensor", dtensor_state(mesh), SerializationFormat.TORCH_SAVE),
        ("dtensor_st", dtensor_state(mesh), SerializationFormat.SAFETENSORS),
        ("fsdp2", fsdp2_state(mesh), SerializationFormat.TORCH_SAVE),
    ):
        folder = os.path.join(root, name)
        dcp.save(state, storage_writer=FileSystemWriter(folder, serialization_format=fmt))
        record(root, name, state)
    megatron_save(os.path.join(root, "megatron"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
