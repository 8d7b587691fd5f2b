"""A Checkpoint 2.0 source on the Ray executor gives the local executor's bytes (virtual ranks' files shipped)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard import api
from reshard.execute.ray import RayOptions
from reshard.formats.strategy import make_strategy
from reshard.layout import ParamLayout
from tests import checkpoint2_fixtures as fx
from tests.trust_helpers import tree


@pytest.mark.parametrize("shared_disk", [True, False])
def test_checkpoint2_to_four_ranks_on_ray(cluster: None, tmp_path: Path, shared_disk: bool) -> None:
    root = tmp_path / "ck"
    full = fx.write_checkpoint2(str(root), fx.dp2_tp4_params(), 8)
    layouts = {n: ParamLayout((4,), (0,) + (-1,) * (a.ndim - 1)) for n, a in full.items() if a.shape[0] % 4 == 0}
    dst = make_strategy(layouts)
    api.transform(str(root), str(tmp_path / "local"), None, dst, output=api.OutputSpec(format="safetensors"))
    run = RayOptions(shared_disk=shared_disk, max_tasks=None if shared_disk else 3)
    api.transform(str(root), str(tmp_path / "ray"), None, dst, run=run, output=api.OutputSpec(format="safetensors"))
    local = {p: h for p, h in tree(str(tmp_path / "local")).items() if not p.startswith("reshard-")}
    assert len(local) == 4
    assert {p: h for p, h in tree(str(tmp_path / "ray")).items() if not p.startswith("reshard-")} == local
