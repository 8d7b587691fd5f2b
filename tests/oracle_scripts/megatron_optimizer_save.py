"""A megatron-core ``torch_dist`` save holding what a training run's checkpoint holds besides the weights.

The optimizer states are made by megatron-core's own ``make_sharded_optimizer_tensor`` with the prefixes
its optimizers use (``optimizer.state.exp_avg`` / ``exp_avg_sq`` / ``fp32_param``; a ChainedOptimizer's
second optimizer under ``chained_1.`` through ``add_prefix_for_sharding``), beside the
DistributedOptimizer's ``optimizer.distributed.…`` object, Megatron-LM's ``rng_state`` and
``rerun_state_machine_state`` objects and its common values. Building a real DistributedOptimizer needs
a DDP model on a GPU; the names and the save are megatron-core's all the same. The weights go to
``weights.npz``.
"""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor  # noqa: E402
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding  # noqa: E402


def main():
    folder = json.loads(sys.argv[1])["folder"]
    dist.init_process_group("gloo")
    torch.manual_seed(3)
    weights = {
        "decoder.layers.self_attention.linear_qkv.weight": torch.randn(8, 6),
        "output_layer.weight": torch.randn(16, 6),
    }
    model = {k: ShardedTensor.from_rank_offsets(k, v.clone(), replica_id=0) for k, v in weights.items()}
    first = {
        f"{state}.{k}": make_sharded_optimizer_tensor(
            sh, torch.randn(sh.local_shape), prefix=f"optimizer.state.{state}"
        )
        for state in ("exp_avg", "exp_avg_sq", "fp32_param")
        for k, sh in model.items()
    }
    second = {
        k: make_sharded_optimizer_tensor(sh, torch.randn(sh.local_shape), prefix="optimizer.state.exp_avg")
        for k, sh in model.items()
    }
    add_prefix_for_sharding(second, "chained_1.")
    state = {
        "model": model,
        "optimizer": {
            "state": first,
            "distributed": ShardedObject(
                "optimizer.distributed.dp_group_idx_0.param_state", {"step": 3}, (1,), (0,), replica_id=0
            ),
            "param_groups": [{"lr": 1e-3, "step": 3}],
        },
        "chained": second,
        "rng_state": ShardedObject("rng_state", {"random_rng_state": [1, 2]}, (1,), (0,), replica_id=0),
        "rerun_state_machine_state": ShardedObject("rerun_state_machine_state", {"mode": 0}, (1,), (0,), replica_id=0),
        "iteration": 7,
        "opt_param_scheduler": {"num_steps": 7},
    }
    os.makedirs(folder, exist_ok=True)
    dist_checkpointing.save(state, folder)
    np.savez(os.path.join(os.path.dirname(folder), "weights.npz"), **{k: v.numpy() for k, v in weights.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
