"""A PyTorch DCP source on the Ray executor gives the local executor's bytes (chunks read through the
registry, on a shared disk; without one it is refused in one line)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reshard import api
from reshard.errors import UnsupportedError
from reshard.execute.ray import RayOptions
from reshard.formats import dcp
from reshard.sources import open_checkpoint
from tests.test_dcp_ops import chunked_files
from tests.trust_helpers import make_job, tree


def test_dcp_to_four_ranks_on_ray(cluster: None, tmp_path: Path) -> None:
    job = make_job(str(tmp_path / "job"))
    with open_checkpoint(job["full"]) as index:
        tensors = {name: np.array(index.array(name)) for name in index.entries}
    src = str(tmp_path / "dcp")
    dcp.save_dcp(src, tensors, chunked_files(tensors), {"extra_state": b"opaque"})
    api.transform(src, str(tmp_path / "local"), None, job["s4"])
    api.transform(src, str(tmp_path / "ray"), None, job["s4"], run=RayOptions(shared_disk=True, max_tasks=3))
    local = {p: h for p, h in tree(str(tmp_path / "local")).items() if not p.startswith("reshard-")}
    assert len(local) == 4
    assert {p: h for p, h in tree(str(tmp_path / "ray")).items() if not p.startswith("reshard-")} == local
    # without a shared disk the .distcp files would be shipped without their .metadata: refused, nothing written
    with pytest.raises(UnsupportedError, match="needs a shared disk"):
        api.transform(src, str(tmp_path / "apart"), None, job["s4"], run=RayOptions(shared_disk=False))
    with pytest.raises(UnsupportedError, match="needs a shared disk"):
        api.unify(src, None, str(tmp_path / "apart"), run=RayOptions(shared_disk=False))
    assert not (tmp_path / "apart").exists()
