"""Block-scaled low precision on the Ray executor (docs/low-precision.md): the local executor's bytes.

FP8 pairs moved as pairs (a transform to a destination strategy), ``--dequantize bf16`` (FP8 blocks and
MXFP4) and ``--quantize fp8-block`` (with and without a model map) run as Ray tasks on a shared disk
and without one (each task is sent the files it reads: the weight's, its scale's); the outputs equal
the local executor's byte for byte. Sources on the nodes' own disks (a placement) are refused in one
line, and a NaN scale is refused before any task starts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reshard import api
from reshard.errors import UnsupportedError, UsageError
from reshard.execute.ray import RayOptions
from reshard.naming.ops import ModelMap, Rename
from reshard.naming.options import NameOptions
from reshard.plan.quantized import Precision
from tests.lowprec_fixtures import bf16_model, fp8_model, fp8_tensors, paired_tensors
from tests.test_lowprec_pairs import FOUR, _strategy
from tests.trust_helpers import tree


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lowprec_ray")
    return {
        "fp8": fp8_model(tmp / "fp8"),
        "paired": fp8_model(tmp / "paired", paired_tensors()),
        "bf16": bf16_model(tmp / "bf16"),
        "tmp": tmp,
    }


def _files(root: Path) -> dict[str, str]:
    return {p: h for p, h in tree(str(root)).items() if not p.startswith("reshard-")}


def _both(tmp_path: Path, shared_disk: bool, call: object) -> None:
    """``call(dst, run)`` locally and on Ray: the same files, byte for byte."""
    assert callable(call)
    call(tmp_path / "local", None)
    call(tmp_path / "ray", RayOptions(shared_disk=shared_disk))
    expected = _files(tmp_path / "local")
    assert expected and _files(tmp_path / "ray") == expected


@pytest.mark.parametrize("shared_disk", [True, False])
def test_dequantize_on_ray_matches_local(
    cluster: None, models: dict[str, Path], tmp_path: Path, shared_disk: bool
) -> None:
    def run(dst: Path, how: RayOptions | None) -> None:
        tensors = api.TensorOptions(precision=Precision("bf16"))
        api.transform(str(models["fp8"]), str(dst), output=api.OutputSpec(format="hf"), tensors=tensors, run=how)

    _both(tmp_path, shared_disk, run)


@pytest.mark.parametrize("shared_disk", [True, False])
@pytest.mark.parametrize("mapped", [False, True], ids=["plain", "renamed"])
def test_quantize_on_ray_matches_local(
    cluster: None, models: dict[str, Path], tmp_path: Path, shared_disk: bool, mapped: bool
) -> None:
    """Renamed: a model map, so the rule applies to the map's outputs, each read as a planned tensor."""
    names = NameOptions(model_map=ModelMap((Rename(r"model\.(.*)", r"m.\1"),))) if mapped else None

    def run(dst: Path, how: RayOptions | None) -> None:
        tensors = api.TensorOptions(names=names, precision=Precision(quantize="fp8-block"))
        api.transform(str(models["bf16"]), str(dst), output=api.OutputSpec(format="hf"), tensors=tensors, run=how)

    _both(tmp_path, shared_disk, run)
    if mapped:
        assert any(p.endswith("model.safetensors") for p in _files(tmp_path / "ray"))


@pytest.mark.parametrize("shared_disk", [True, False])
def test_pairs_resharded_on_ray_match_local(
    cluster: None, models: dict[str, Path], tmp_path: Path, shared_disk: bool
) -> None:
    s4 = _strategy(tmp_path / "s4.ckpt", FOUR)

    def run(dst: Path, how: RayOptions | None) -> None:
        api.transform(
            str(models["paired"]), str(dst), None, str(s4), output=api.OutputSpec(format="safetensors"), run=how
        )

    _both(tmp_path, shared_disk, run)


def test_a_placement_is_refused_in_one_line(cluster: None, models: dict[str, Path], tmp_path: Path) -> None:
    tensors = api.TensorOptions(precision=Precision("bf16"))
    out = tmp_path / "out"
    with pytest.raises(UnsupportedError, match="placement") as caught:
        api.transform(
            str(models["fp8"]),
            str(out),
            output=api.OutputSpec(format="hf"),
            tensors=tensors,
            run=RayOptions(placement="auto"),
        )
    assert "\n" not in str(caught.value)
    assert not out.exists()


def test_a_nan_scale_is_refused_before_any_task(cluster: None, tmp_path: Path) -> None:
    """The plan made from good files, then a scale turned NaN in place (same header): refused on the driver."""
    t = fp8_tensors()
    src = fp8_model(tmp_path / "src", t)
    report = api.transform(
        str(src),
        str(tmp_path / "out"),
        output=api.OutputSpec(format="hf"),
        destination=api.Destination(dry_run=True),
        tensors=api.TensorOptions(precision=Precision("bf16")),
    )
    scale = next(n for n in t if n.endswith("_scale_inv") and t[n].dtype == np.float32)
    t[scale] = t[scale].copy()
    t[scale][0, 0] = np.nan
    fp8_model(tmp_path / "src", t)
    with pytest.raises(UsageError, match="NaN or infinite") as caught:
        api.execute(report.plan, root=str(tmp_path / "out"), executor="ray")
    assert scale in str(caught.value)
    assert not (tmp_path / "out").exists()
