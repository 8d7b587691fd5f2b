"""``--weights-only`` on PyTorch checkpoints: megatron-core's optimizer keys, Megatron-LM's training objects
and a DCP optimizer state dict's flattened entries are training state (``reshard.statenames``).

The oracle part saves a ``torch_dist`` checkpoint through megatron-core with the optimizer keys its
optimizers write (``tests/oracle_scripts/megatron_optimizer_save.py``), exports it with
``--weights-only`` to safetensors and to ``torch_dist`` (no optimizer tensor, no training-state value,
megatron's empty ``common.pt``), and megatron-core loads the weights back bit for bit
(``tests/oracle_scripts/megatron_weights_load.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reshard.formats import dcp
from reshard.formats.safetensors import read_safetensors
from reshard.naming.filters import name_filter
from reshard.statenames import DEFAULT, StateNames
from tests.torch_oracle import run_torch_script
from tests.trust_helpers import run_cli

WEIGHTS = ["decoder.layers.self_attention.linear_qkv.weight", "output_layer.weight"]

STATE = [
    "optimizer.state.exp_avg.decoder.layers.0.self_attention.linear_qkv.weight",  # megatron-core
    "optimizer.state.exp_avg_sq.output_layer.weight",
    "optimizer.state.fp32_param.embedding.word_embeddings.weight",
    "chained_1.optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight",  # ChainedOptimizer
    "chained_12.optimizer.distributed.dp_group_idx_0.param_state/shard_0_2",
    "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.bfloat16).param_state/shard_0_1",
    "rng_state/shard_0.0_1.2",  # Megatron-LM's ShardedObjects
    "rerun_state_machine_state/shard_0_1",
    "rng_state",
    "optimizer.state.layers.0.attention.wq.weight.exp_avg",  # torchtitan's flattened optimizer state dict
    "optimizer.param_groups.layers.0.attention.wq.weight.lr",
    "optim.state.tok_embeddings.weight.exp_avg_sq",  # torchtune's
]

WEIGHT_NAMES = [
    *WEIGHTS,
    "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2",  # a layer's extra state is the model's
    "chained_1.decoder.weight",
    "optimizer_head.weight",
    "layers.0.optim_gate.weight",
    "model.rng_state_proj.weight",
]


@pytest.mark.parametrize("name", STATE)
def test_pytorch_training_state_is_state(name: str) -> None:
    assert DEFAULT.is_state(name)
    assert name_filter(weights_only=True).dropped_by(name) == "--weights-only"


@pytest.mark.parametrize("name", WEIGHT_NAMES)
def test_weights_are_not(name: str) -> None:
    assert not DEFAULT.is_state(name)
    assert name_filter(weights_only=True).dropped_by(name) is None


def test_a_chained_prefix_only_wraps_the_known_prefixes() -> None:
    rule = StateNames().with_prefixes(["ema."])
    assert rule.is_state("chained_0.ema.w") and rule.is_state("ema.w")
    assert not DEFAULT.is_state("chained_0.ema.w") and not DEFAULT.is_state("chained_x.optimizer.state.w")


# ------------------------------------------------------------------------------------ megatron-core


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("megatron-optimizer")
    run_torch_script("megatron_optimizer_save.py", {"folder": str(root / "ckpt")}, nproc=1)
    return root


def _weights(saved: Path) -> dict[str, np.ndarray]:
    with np.load(saved / "weights.npz") as data:
        return {k: data[k] for k in data.files}


def test_the_save_holds_optimizer_state(saved: Path) -> None:
    meta = dcp.read_dcp_metadata(saved / "ckpt")
    assert len(meta.tensors) == 10 and sorted(t for t in meta.tensors if not DEFAULT.is_state(t)) == WEIGHTS
    assert sorted(meta.byte_items) == [
        "optimizer.distributed.dp_group_idx_0.param_state/shard_0_1",
        "rerun_state_machine_state/shard_0_1",
        "rng_state/shard_0_1",
    ]


def test_weights_only_to_safetensors(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "st"
    done = run_cli("transform", str(saved / "ckpt"), str(out), "--output-format", "safetensors", "--weights-only")
    assert done.returncode == 0, done.stderr
    assert "8 dropped by a filter" in done.stderr and "dropped   8 (--weights-only): optimizer.state." in done.stderr
    with read_safetensors(str(out / "rank_0" / "checkpoint_0.safetensors")) as index:
        got = {n: np.array(index.array(n)) for n in index}
    want = _weights(saved)
    assert sorted(got) == WEIGHTS and all(got[k].tobytes() == want[k].tobytes() for k in WEIGHTS)
    check = run_cli("verify", str(saved / "ckpt"), str(out), "--weights-only")
    assert check.returncode == 0 and "SAME: 2 match" in check.stdout, check.stdout + check.stderr


def test_weights_only_to_torch_dist_loads_in_megatron(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "td"
    done = run_cli("transform", str(saved / "ckpt"), str(out), "--output-format", "torch_dist", "--weights-only")
    assert done.returncode == 0, done.stderr
    assert "--weights-only: 3 training-state values not carried (optimizer.distributed." in done.stderr
    assert "common.pt (iteration, optimizer param groups) not carried" in done.stderr
    result = tmp_path / "loaded.json"
    run_torch_script(
        "megatron_weights_load.py",
        {"folder": str(out), "weights": str(saved / "weights.npz"), "out": str(result)},
        nproc=1,
    )
    assert json.loads(result.read_text()) == {"names": WEIGHTS, "common": []}


def test_without_weights_only_everything_is_carried(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "all"
    done = run_cli("transform", str(saved / "ckpt"), str(out), "--output-format", "torch_dist")
    assert done.returncode == 0, done.stderr
    meta = dcp.read_dcp_metadata(out)
    assert len(meta.tensors) == 10 and len(meta.byte_items) == 3
    assert (out / "common.pt").read_bytes() == (saved / "ckpt" / "common.pt").read_bytes()


def test_inspect_groups_chained_states_by_optimizer() -> None:
    from reshard.inspection import _state_kind

    assert DEFAULT.prefix_of("chained_1.optimizer.state.exp_avg.w") == "chained_1.optimizer."
    kinds = ["chained_1.optimizer.state.exp_avg.w", "optimizer.state.fp32_param.w", "rng_state/shard_0_1", "w"]
    assert [_state_kind(n) for n in kinds] == ["chained_1.optimizer", "optimizer", "rng_state", None]
