# Runs INSIDE the PyTorch venv (scripts/torch_env.sh) under `torchrun --nproc_per_node 2` (gloo, CPU),
# started by tests/torch_oracle.py: megatron-core's dist_checkpointing.load of torch_dist checkpoints
# (reshard's outputs) into a tensor-parallel layout of its own, compared with the full tensors.
#
# argv[1] is JSON {"loads": [{"folder": F, "expected": NPZ, "split": {name: axis or null}, "bf16": [names],
# "out": JSON}]}. For each load every rank builds a ShardedTensor per name of the .npz: its part along
# `axis` (from_rank_offsets (axis, rank, world)), or the whole tensor replicated (null); megatron loads
# them from F; each rank compares its part bit for bit with the .npz (bf16 kept as int16 bit patterns).
# Rank 0 writes OUT: {"mismatched": [...], "loaded": n, "common": repr(load_common_state_dict(F))}.
# A mismatch on any rank exits non-zero.
# A load with "model": [tp, pp] and "resave": R instead loads megatron_save.py's tiny GPTModel on that
# layout from F (its own sharded_state_dict(), ShardedObjects included), load_state_dict()s it, and
# saves it again into R, for reshard to compare with the checkpoint F was made from.

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64, "int32": torch.int32}


def part(full, axis, rank, world):
    if axis is None:
        return full
    size = full.shape[axis] // world
    return np.take(full, range(rank * size, (rank + 1) * size), axis=axis)


def sharded_state(expected, split, bf16, rank, world):
    state = {}
    for name, full in expected.items():
        dtype = torch.bfloat16 if name in bf16 else TORCH_DTYPES[str(full.dtype)]
        axis = split.get(name)
        local = part(full, axis, rank, world)
        empty = torch.zeros(local.shape, dtype=dtype)
        if axis is None:
            state[name] = ShardedTensor.from_rank_offsets(name, empty, replica_id=rank)
        else:
            state[name] = ShardedTensor.from_rank_offsets(name, empty, (axis, rank, world))
    return state


def compare(loaded, expected, split, bf16, rank, world):
    mismatched = []
    for name, full in expected.items():
        got = loaded[name].detach().contiguous()
        got = (got.view(torch.int16) if name in bf16 else got).numpy()
        want = part(full, split.get(name), rank, world)
        if got.shape != want.shape or got.tobytes() != np.ascontiguousarray(want).tobytes():
            mismatched.append(name)
    return mismatched


def load_model(load):
    from megatron_save import gpt_model, save

    tp, pp = load["model"]
    model = gpt_model(tp, pp)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), load["folder"]))
    save(load["resave"], model.sharded_state_dict())
    if dist.get_rank() == 0:
        with open(load["out"], "w") as fh:
            json.dump({"mismatched": [], "loaded": len(model.state_dict()), "common": "{}"}, fh)


def main():
    loads = json.loads(sys.argv[1])["loads"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = False
    for load in loads:
        if "model" in load:
            load_model(load)
            continue
        with np.load(load["expected"]) as data:
            expected = {k: data[k] for k in data.files}
        split, bf16 = load["split"], set(load.get("bf16", []))
        state = sharded_state(expected, split, bf16, rank, world)
        loaded = dist_checkpointing.load(state, load["folder"])
        mismatched = compare(loaded, expected, split, bf16, rank, world)
        gathered = [None] * world
        dist.all_gather_object(gathered, mismatched)
        everyone = sorted({n for m in gathered for n in m})
        failed = failed or bool(everyone)
        if rank == 0:
            common = dist_checkpointing.load_common_state_dict(load["folder"])
            with open(load["out"], "w") as fh:
                json.dump({"mismatched": everyone, "loaded": len(expected), "common": repr(common)}, fh)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
