"""megatron-core loads a weights-only ``torch_dist`` output: every weight of ``weights.npz``, bit for bit,
and ``.metadata`` lists no training state (``result.json``: the names it holds)."""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402


def main():
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    with np.load(args["weights"]) as saved:
        want = {k: saved[k] for k in saved.files}
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(v.shape), replica_id=0) for k, v in want.items()}
    loaded = dist_checkpointing.load(request, args["folder"])
    for k, v in want.items():
        assert loaded[k].numpy().tobytes() == v.tobytes(), k
    metadata = torch.distributed.checkpoint.FileSystemReader(args["folder"]).read_metadata()
    with open(os.path.join(args["out"]), "w") as fh:
        json.dump(
            {
                "names": sorted(metadata.state_dict_metadata),
                "common": sorted(dist_checkpointing.load_common_state_dict(args["folder"])),
            },
            fh,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
