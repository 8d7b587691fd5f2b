# Runs INSIDE the PyTorch venv (scripts/torch_env.sh) under `torchrun --nproc_per_node 2` (gloo, CPU),
# started by tests/torch_oracle.py: saves real Megatron-core torch_dist checkpoints with
# megatron.core.dist_checkpointing.save (megatron-core 0.16.1).
#
# argv[1] is JSON {"root": folder}. Under the root, rank 0 writes one folder per checkpoint and, beside
# each, <name>.npz with the full tensors saved (bf16 as its int16 bit pattern: numpy has no bf16).
#   handmade   ShardedTensors built by hand: split along dim 0 and dim 1 (from_rank_offsets),
#              replicated (replica_id), bf16, a stacked layer axis prepended
#              (prepend_axis_num=1, each rank one layer as a pipeline stage), a ShardedObject, and a
#              non-sharded value (into common.pt).
#   gpt_pp2    a tiny GPTModel (2 layers, use_cpu_initialization) on 2 pipeline stages: its
#              sharded_state_dict(), layers stacked along a leading axis, each stage saving its range.
#   gpt_tp2    the same model on 2 tensor-parallel ranks.
# Uneven boxes cannot be saved: megatron-core 0.16.1 wants each global offset divisible by the local
# shape and refuses flattened ranges (the reader's uneven chunks are tests/test_dcp_oracle.py's, from torch).
# And empty/common.pt: torch.save({}, ...) into a file named common.pt, for reshard's bytes to compare.
#
# Megatron's saver assumes CUDA in two places that do not touch the format; they are replaced first.

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor  # noqa: E402


def bits(tensor):
    tensor = tensor.detach().contiguous()
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def handmade_state(rank, world):
    torch.manual_seed(1)
    rows = torch.randn(8, 6)
    cols = torch.randn(4, 6).to(torch.bfloat16)
    layers = torch.randn(2, 4, 6)  # a stacked layer axis, one layer per "pipeline stage"
    state = {
        "rows": ShardedTensor.from_rank_offsets(
            "decoder.layers.self_attention.linear_qkv.weight", rows[rank * 4 : rank * 4 + 4].clone(), (0, rank, world)
        ),
        "cols": ShardedTensor.from_rank_offsets(
            "output_layer.weight", cols[:, rank * 3 : rank * 3 + 3].clone(), (1, rank, world)
        ),
        "norm": ShardedTensor.from_rank_offsets(
            "decoder.final_layernorm.weight", torch.full((6,), 0.5), replica_id=rank
        ),
        "stack": ShardedTensor.from_rank_offsets(
            "decoder.layers.mlp.linear_fc1.weight", layers[rank].clone(), (0, rank, world), prepend_axis_num=1
        ),
        "obj": ShardedObject("decoder.layers.mlp.linear_fc1._extra_state", b"opaque", (world,), (rank,), replica_id=0),
        "iteration": 7,
    }
    expected = {
        "decoder.layers.self_attention.linear_qkv.weight": bits(rows),
        "output_layer.weight": bits(cols),
        "decoder.final_layernorm.weight": bits(torch.full((6,), 0.5)),
        "decoder.layers.mlp.linear_fc1.weight": bits(layers),
    }
    return state, expected


def gpt_model(tp, pp):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(2)
    config = TransformerConfig(
        num_layers=2, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
    )  # fmt: skip
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=16, max_sequence_length=8,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
    )  # fmt: skip


def saved_full(folder):
    """The full tensors of a saved checkpoint, as torch's own DCP reader gives them (rank 0, after the save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder + ".pt"
    dcp_to_torch_save(folder, out)
    state = torch.load(out, weights_only=False)
    os.remove(out)
    return {k: bits(v) for k, v in state.items() if isinstance(v, torch.Tensor)}


def save(folder, state):
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)  # megatron saves into an existing, empty folder
    dist.barrier()
    dist_checkpointing.save(state, folder)
    dist.barrier()


def main():
    root = json.loads(sys.argv[1])["root"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state, expected = handmade_state(rank, world)
    save(os.path.join(root, "handmade"), state)
    if rank == 0:
        np.savez(os.path.join(root, "handmade.npz"), **expected)
    for name, tp, pp in (("gpt_pp2", 1, 2), ("gpt_tp2", 2, 1)):
        model = gpt_model(tp, pp)
        save(os.path.join(root, name), model.sharded_state_dict())
        if rank == 0:
            np.savez(os.path.join(root, f"{name}.npz"), **saved_full(os.path.join(root, name)))
    if rank == 0:
        os.makedirs(os.path.join(root, "empty"), exist_ok=True)
        torch.save({}, os.path.join(root, "empty", "common.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
