"""FP8 block pairs through a model map while resharding to a destination strategy (docs/low-precision.md §4).

A rule that renames a weight and its scale alike keeps the pair: each rank's files hold the bytes the same
run without the map writes, under the new names (a full model split, rank folders transformed). A map
that renames the weight alone, or transposes it, is refused in one line naming the weight and what the
map made of it and of its scale, nothing written; ``--dequantize`` consumes the scales first and passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reshard import api
from reshard.errors import UnsupportedError
from reshard.formats.safetensors import read_safetensors
from reshard.layout import ParamLayout
from reshard.naming.ops import ModelMap, Rename, Transpose
from reshard.naming.options import NameOptions
from reshard.plan.quantized import Precision
from tests.lowprec_fixtures import DOWN, UP, fp8_model, paired_tensors
from tests.test_lowprec_pairs import FOUR, TWO, _strategy
from tests.trust_helpers import run_cli

BOTH = Rename(r"model\.(.*)", r"m.\1")  # the weight and its scale alike
UP_T = UP.replace("up_proj", "up_t")


def _renamed(name: str) -> str:
    return name.replace("model.", "m.", 1)


def _ranks(folder: Path) -> dict[int, dict[str, bytes]]:
    out = {}
    for part in sorted(folder.glob("rank_*/*.safetensors")):
        with read_safetensors(str(part)) as index:
            out[int(part.parent.name[5:])] = {n: bytes(index.array(n).tobytes()) for n in index.entries}
    return out


def _names(model_map: ModelMap) -> api.TensorOptions:
    return api.TensorOptions(names=NameOptions(model_map=model_map))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fp8_model(tmp_path_factory.mktemp("map") / "fp8", paired_tensors())


def test_split_renames_each_pair_alike(model: Path, tmp_path: Path) -> None:
    plain, mapped = tmp_path / "plain", tmp_path / "mapped"
    api.split(str(model), str(_strategy(tmp_path / "s4.ckpt", FOUR)), str(plain))
    renamed = _strategy(tmp_path / "s4m.ckpt", {_renamed(k): v for k, v in FOUR.items()})
    report = api.split(str(model), str(renamed), str(mapped), tensors=_names(ModelMap((BOTH,))))
    assert any("block scales cut with their weights" in n and "3 pair(s)" in n for n in report.notes)
    want = {r: {_renamed(n): b for n, b in files.items()} for r, files in _ranks(plain).items()}
    assert want and _ranks(mapped) == want


def test_rank_folders_transformed_with_a_rename(model: Path, tmp_path: Path) -> None:
    s4, s2 = _strategy(tmp_path / "s4.ckpt", FOUR), _strategy(tmp_path / "s2.ckpt", TWO)
    four, plain, mapped = tmp_path / "four", tmp_path / "plain", tmp_path / "mapped"
    api.transform(str(model), str(four), None, str(s4), output=api.OutputSpec(format="safetensors"))
    api.transform(str(four), str(plain), str(s4), str(s2))
    api.transform(str(four), str(mapped), str(s4), str(s2), tensors=_names(ModelMap((BOTH,))))
    want = {r: {_renamed(n): b for n, b in files.items()} for r, files in _ranks(plain).items()}
    assert want and _ranks(mapped) == want


@pytest.mark.parametrize("how", ["rename", "transpose"])
def test_a_map_breaking_a_pair_is_refused_in_one_line(model: Path, tmp_path: Path, how: str) -> None:
    strategy = _strategy(tmp_path / "s.ckpt", {UP_T: ParamLayout((2,), (0, -1)), DOWN: ParamLayout((2,), (-1, 0))})
    if how == "rename":
        rule = {"match": r"(.*)up_proj\.weight", "replace": r"\1up_t.weight"}
    else:
        rule = {"op": "transpose", "match": r"(.*)up_proj\.weight", "replace": r"\1up_t.weight", "perm": [1, 0]}
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([rule]))
    out = tmp_path / "out"
    proc = run_cli("split", str(model), str(out), "--dst-strategy", str(strategy), "--rename", str(rules))
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, proc.stderr
    assert UP in line and UP_T in line and UP + "_scale_inv" in line and "--dequantize" in line, line
    assert not out.exists()


def test_transpose_through_the_api_names_what_it_made(model: Path, tmp_path: Path) -> None:
    strategy = _strategy(tmp_path / "s.ckpt", {UP_T: ParamLayout((2,), (0, -1))})
    op = Transpose(r"(.*)up_proj\.weight", r"\1up_t.weight", (1, 0))
    with pytest.raises(UnsupportedError, match="transposed or reshaped"):
        api.split(str(model), str(strategy), str(tmp_path / "out"), tensors=_names(ModelMap((op,))))
    assert not (tmp_path / "out").exists()


def test_dequantize_consumes_the_scales_before_the_map(model: Path, tmp_path: Path) -> None:
    strategy = _strategy(tmp_path / "s.ckpt", {UP_T: ParamLayout((2,), (0, -1))})
    names = NameOptions(model_map=ModelMap((Rename(r"(.*)up_proj\.weight", r"\1up_t.weight"),)))
    tensors = api.TensorOptions(names=names, precision=Precision("bf16"))
    api.split(str(model), str(strategy), str(tmp_path / "out"), tensors=tensors)
    ranks = _ranks(tmp_path / "out")
    assert UP_T in ranks[0] and not any(n.endswith("_scale_inv") for n in ranks[0])
