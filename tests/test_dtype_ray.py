"""--dtype on the Ray executor: the same bytes as the local executor in every mode, and overflow rolls back.

Three ways Ray runs a plan: tasks reading a shared disk, tasks fed whole files through the driver
(``shared_disk=False``), and tasks on the nodes holding the sources with byte ranges fetched across
nodes (a placement, ``execute.ray_nodes``). Each ends in ``local.run_file``, where the cast
happens; these tests keep it so. One local cluster of two one-CPU nodes stands in for a job; the
placement says node_a holds ranks 0-3 and node_b ranks 4-7, so the cast reads fetched ranges.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

from reshard import api
from reshard.errors import UsageError
from reshard.execute.ray import RayOptions
from reshard.execute.ray_nodes import NodeRun
from reshard.formats.ckpt import save_ckpt
from reshard.sources import open_checkpoint
from tests.trust_helpers import make_job, tree

HOLDS = {"node_a": range(0, 4), "node_b": range(4, 8)}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("job")))


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    nodes.add_node(num_cpus=1, resources={"node_b": 1})
    ray.init(address=nodes.address, log_to_driver=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()
        nodes.shutdown()


def _tensor_files(root: str) -> dict[str, str]:
    return {p: h for p, h in tree(root).items() if not p.startswith("reshard-")}


def _placement(tmp_path: Any, job: dict[str, str]) -> str:
    path = tmp_path / "placement.json"
    folders = {n: [os.path.join(job["r8"], f"rank_{r}") for r in ranks] for n, ranks in HOLDS.items()}
    path.write_text(json.dumps({"nodes": folders}))
    return str(path)


@pytest.mark.parametrize("mode", ["shared-disk", "driver-shipped", "placement"])
def test_ray_casts_like_the_local_executor(cluster: None, job: dict[str, str], tmp_path: Any, mode: str) -> None:
    local, on_ray = str(tmp_path / "local"), str(tmp_path / "ray")
    api.transform(job["r8"], local, job["s8"], job["s4"], tensors=api.TensorOptions(dtype="bf16"))
    runs: list[NodeRun] = []
    run = {
        "shared-disk": RayOptions(),
        "driver-shipped": RayOptions(shared_disk=False, max_tasks=2),
        "placement": RayOptions(placement=_placement(tmp_path, job), on_nodes=runs.append),
    }[mode]
    api.transform(job["r8"], on_ray, job["s8"], job["s4"], run=run, tensors=api.TensorOptions(dtype="bf16"))
    expected = _tensor_files(local)
    assert expected and _tensor_files(on_ray) == expected
    if mode == "placement":
        assert runs and runs[-1].schedule.cross_node_bytes > 0  # fetched ranges were cast


@pytest.mark.parametrize("shared_disk", [True, False])
def test_overflow_on_ray_is_one_error_and_nothing_stays(
    cluster: None, job: dict[str, str], tmp_path: Any, shared_disk: bool
) -> None:
    """One value of a full model beyond float16's range: the task's error reaches the caller as the
    same one-line UsageError, and the run's outputs are rolled back."""
    with open_checkpoint(job["full"]) as index:
        model = {n: np.array(index.array(n)) for n, e in index.entries.items() if not e.is_string}
    name = next(n for n, a in model.items() if a.dtype == np.float32 and a.ndim == 2 and not n.startswith("adam"))
    model[name].reshape(-1)[0] = 3e5
    src = str(tmp_path / "big.ckpt")
    save_ckpt(src, model)
    dst = tmp_path / "out"
    with pytest.raises(UsageError, match=f"^{name}: cast to Float16 overflows: largest magnitude 300000"):
        api.transform(
            src,
            str(dst),
            None,
            job["s4"],
            run=RayOptions(shared_disk=shared_disk),
            tensors=api.TensorOptions(dtype="fp16"),
        )
    assert not dst.exists()
