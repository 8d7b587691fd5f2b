"""``reshard show`` and ``reshard plan --picture`` (issue 13, show lane): the scene, its SVG and its
terminal text form agree with the layout algebra and the plan; bad input is one line, exit 2,
nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from reshard import api, layout, picture
from reshard.errors import UnsupportedError
from reshard.formats.strategy import load_strategy
from reshard.layout import ParamLayout
from tests.trust_helpers import run_cli as run

EMBEDDING = "model.tok_embeddings.embedding_weight"  # stage 0 and stage 1 lay it out differently
WQ = "model.layers.0.attention.wq.weight"
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("demo"))
    proc = run("demo", "--dir", root)
    assert proc.returncode == 0, proc.stderr
    return {
        "full": f"{root}/full/model.ckpt",
        "r8": f"{root}/ckpt_8ranks",
        "s8": f"{root}/merged/src_strategy.ckpt",
        "s4": f"{root}/merged/dst_strategy.ckpt",
        "s8_dir": f"{root}/strategy_8",
        "mf2": f"{root}/mf2_8ranks",
    }


def one_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error:"), proc.stderr
    return lines[0]


def svg_rects(path: Path, kind: str) -> list[ET.Element]:
    root = ET.parse(path).getroot()
    return [r for r in root.iter(f"{SVG}rect") if r.get("data-kind") == kind]


def svg_texts(path: Path) -> list[str]:
    return [t.text or "" for t in ET.parse(path).getroot().iter(f"{SVG}text")]


def expected_slices(strategy: str, name: str, shape: tuple[int, ...]) -> dict[int, set[tuple[int, ...]]]:
    """Stage -> the rank groups holding each distinct box, from the layout algebra itself."""
    from reshard.inspection import stage_layouts

    sf = load_strategy(strategy)
    found: dict[int, set[tuple[int, ...]]] = {}
    for stage, p in stage_layouts(sf, name).items():
        groups: dict[tuple, list[int]] = {}
        for local, box in enumerate(layout.rank_boxes(p, shape)):
            groups.setdefault(box, []).append(stage * p.device_num + local)
        found[stage] = {tuple(g) for g in groups.values()}
    return found


# ------------------------------------------------------------------------------------ show


def test_svg_has_one_labelled_block_per_rank_slice(demo: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "emb.svg"
    proc = run("show", demo["r8"], "--strategy", demo["s8"], EMBEDDING, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    shape = api.source_file(demo["full"]).tensors[EMBEDDING].shape
    want = expected_slices(demo["s8"], EMBEDDING, shape)
    slices = svg_rects(out, "slice")
    got = {tuple(int(r) for r in rect.get("data-ranks", "").split()) for rect in slices}
    assert len(slices) == sum(len(groups) for groups in want.values())
    assert got == set().union(*want.values())
    assert {r for g in got for r in g} == set(range(8))  # both stages drawn, every rank on it
    texts = svg_texts(out)
    assert all(picture.ranges_label(tuple(int(r) for r in s.get("data-ranks", "").split())) in texts for s in slices)
    assert any("stage 1 (ranks 4-7)" in t for t in texts) and any("stage 0 (ranks 0-3)" in t for t in texts)
    blocks = svg_rects(out, "block")  # the optimizer shard of the demo: model-parallel blocks outlined
    assert blocks and all(len(b.get("data-ranks", "").split()) == 2 for b in blocks)
    assert all(rect.find(f"{SVG}title") is not None for rect in slices)


def test_replicas_share_one_block(demo: dict[str, str], tmp_path: Path) -> None:
    """A Checkpoint 2.0's layouts carry no optimizer shard: ranks 0 and 2 hold one block of wq."""
    out = tmp_path / "wq.svg"
    proc = run("show", demo["mf2"], WQ, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    ranks = sorted(rect.get("data-ranks") for rect in svg_rects(out, "slice"))
    assert ranks == ["0 2", "1 3"]
    assert "rows 0:64           0,2" in proc.stdout and "replicas" in proc.stdout


def test_text_form_is_a_grid_of_ranks(demo: dict[str, str]) -> None:
    proc = run("show", demo["r8"], EMBEDDING, "--strategy", demo["s8"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    stage1 = lines.index(next(line for line in lines if "stage 1 (ranks 4-7)" in line))
    grid = [line.split() for line in lines[stage1 + 1 : stage1 + 4]]
    assert grid[0] == ["cols", "0:64", "cols", "64:128"]
    assert grid[1] == ["rows", "0:256", "4", "5"] and grid[2] == ["rows", "256:512", "6", "7"]
    assert "wrote" not in proc.stdout  # no -o: text only


def test_strategy_alone_draws_in_blocks_and_defaults_to_distinct_layouts(demo: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "all.svg"
    proc = run("show", demo["s8"], "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("no PARAM given: drawing the first parameter of each of ")
    views = picture.param_views(load_strategy(demo["s8"]))
    names, _ = picture.choose_params(views, None)
    assert 1 < len(names) <= picture.DEFAULT_PANELS and names[0] == EMBEDDING
    scene = picture.param_scene(views, names)
    assert len(svg_rects(out, "slice")) == sum(1 for r in scene.rects if r.kind == "slice")
    assert any("(in blocks)" in t for t in svg_texts(out))
    layouts = {tuple(sorted(views[n].stages.items())) for n in names}
    assert len(layouts) == len(names)  # each drawn parameter shows another layout
    per_stage = run("show", f"{demo['s8_dir']}/ckpt_strategy_rank_4.ckpt", "model.layers.2.attention.wq.weight")
    assert per_stage.returncode == 0 and "stage 1 (ranks 4-7)" in per_stage.stdout, per_stage.stderr


def test_scene_slices_match_the_algebra() -> None:
    p = ParamLayout((2, 2, 2), (2, 0, -1), 2, 2)
    view = picture.ParamView("w", {0: p}, (16, 8, 4), True, 8)
    (panel,) = picture.param_panel(view, 0)
    boxes = layout.rank_boxes(p, (16, 8, 4))
    assert {r.box for r in panel.slices} == set(boxes)
    assert all(boxes[r] == s.box for s in panel.slices for r in s.ranks)
    assert picture.all_ranks(panel.slices) == set(range(8))
    three_d = picture.ParamView("x", {0: ParamLayout((2, 2), (-1, -1, 0))}, (4, 4, 8), True, 4)
    panels = picture.param_panel(three_d, 0)
    assert len(panels) == 2 and all("dims 2+" in q.title for q in panels)


# ------------------------------------------------------------------------------------ plan --picture


def test_plan_picture_cells_are_the_plans_bytes(demo: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "plan.svg"
    args = ["--src", demo["r8"], "--dst", str(tmp_path / "dst"), "--src-strategy", demo["s8"]]
    proc = run("plan", *args, "--dst-strategy", demo["s4"], "--picture", str(out))
    assert proc.returncode == 0, proc.stderr
    report = api.transform(
        demo["r8"], str(tmp_path / "dst"), demo["s8"], demo["s4"], destination=api.Destination(dry_run=True)
    )
    matrix = picture.plan_matrix(report.plan)
    cells = {(c.get("data-src"), c.get("data-dst")): int(c.get("data-bytes", "-1")) for c in svg_rects(out, "cell")}
    assert len(cells) == 8 * 4 and sum(cells.values()) == report.plan.bytes_read == matrix.total
    assert {k: v for k, v in cells.items() if v} == dict(matrix.cells)
    assert all(cells[(str(s), str(d))] == 0 for s in range(4, 8) for d in (0, 1))  # stage 1 feeds only 2, 3
    assert not (tmp_path / "dst").exists()
    lines = proc.stdout.splitlines()
    head = lines.index(next(line for line in lines if line.strip().startswith("src \\ dst")))
    assert lines[head].split()[-4:] == ["0", "1", "2", "3"] and len(lines[head + 1 : head + 9]) == 8
    assert lines[head + 5].split()[:4] == ["4", ".", ".", picture.short_size(matrix.cells[("4", "2")])]
    assert lines[-1] == f"wrote {out}"


def test_plan_matrix_text_lists_destinations_when_wide() -> None:
    matrix = picture.Matrix(tuple(str(i) for i in range(20)), tuple(str(i) for i in range(20)), {("3", "7"): 2048})
    lines = picture.matrix_text(matrix)
    assert len(lines) == 20 and lines[7] == "dst 7 <- 3 (2KiB)" and lines[0] == "dst 0 <- "


def test_checkpoint2_plan_sources_are_ranks(demo: dict[str, str], tmp_path: Path) -> None:
    report = api.transform(
        demo["mf2"], str(tmp_path / "dst"), None, demo["s4"], destination=api.Destination(dry_run=True)
    )
    matrix = picture.plan_matrix(report.plan)
    assert set(matrix.sources) <= {str(r) for r in range(8)} and matrix.total == report.plan.bytes_read


# ------------------------------------------------------------------------------------ PNG


def test_png_without_matplotlib_is_one_clear_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UnsupportedError, match=r"pip install 'reshard\[picture\]'"):
        picture.check_output(str(tmp_path / "x.png"))


def test_png_refused_through_the_cli_when_matplotlib_is_missing(demo: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "x.png"
    code = (
        "import sys; sys.modules['matplotlib'] = None; from reshard import cli; "
        f"sys.argv = ['reshard', 'show', {demo['s8']!r}, {WQ!r}, '-o', {str(out)!r}]; sys.exit(cli.main())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "reshard[picture]" in one_error(proc) and not out.exists()


def test_png_with_matplotlib(demo: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the optional extra reshard[picture] is not installed")
    out = tmp_path / "wq.png"
    proc = run("show", demo["s8"], WQ, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------ bad input


def test_unknown_param_names_close_ones(demo: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "x.svg"
    line = one_error(run("show", demo["s8"], "model.layers.0.attention.wqq", "-o", str(out)))
    assert "did you mean model.layers.0.attention.wq.weight" in line and not out.exists()
    line = one_error(run("show", demo["s8"], "zzzz"))
    assert "no parameter 'zzzz'" in line and "did you mean" not in line


@pytest.mark.parametrize(
    "name, words",
    [("x.pdf", "cannot draw a .pdf"), ("x", "file without extension"), ("missing/x.svg", "does not exist")],
)
def test_bad_output_names(demo: dict[str, str], tmp_path: Path, name: str, words: str) -> None:
    out = tmp_path / name
    assert words in one_error(run("show", demo["s8"], WQ, "-o", str(out)))
    args = ["--src", demo["r8"], "--dst", str(tmp_path / "dst"), "--src-strategy", demo["s8"]]
    assert words in one_error(run("plan", *args, "--dst-strategy", demo["s4"], "--picture", str(out)))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, no folder made


def test_sources_without_a_strategy(demo: dict[str, str], tmp_path: Path) -> None:
    assert "several rank folders but no source strategy: give --strategy" in one_error(run("show", demo["r8"], WQ))
    assert "give a strategy with --strategy" in one_error(run("show", demo["full"], WQ))
    assert "give no --strategy" in one_error(run("show", demo["s8"], "--strategy", demo["s8"]))
    assert "metadata.json: give no --strategy" in one_error(run("show", demo["mf2"], "--strategy", demo["s8"]))
    assert "no such file or folder" in one_error(run("show", str(tmp_path / "nothing")))


def test_a_full_model_with_a_strategy_draws_its_real_shapes(demo: dict[str, str]) -> None:
    """How a strategy would split a full model: the tensors' own shapes, the same as from the rank folders."""
    full = run("show", demo["full"], EMBEDDING, "--strategy", demo["s8"])
    ranks = run("show", demo["r8"], EMBEDDING, "--strategy", demo["s8"])
    assert full.returncode == 0 and full.stdout == ranks.stdout, full.stderr
    assert "[512, 128], stage 0" in full.stdout


def test_json_of_inspect_is_unchanged_by_show(demo: dict[str, str]) -> None:
    """show reads; it never writes beside its source."""
    before = json.loads(run("inspect", demo["s8"], "--json").stdout)
    run("show", demo["s8"])
    assert json.loads(run("inspect", demo["s8"], "--json").stdout) == before


def test_rank_folders_find_their_strategy_where_mindformers_keeps_it(demo: dict[str, str], tmp_path: Path) -> None:
    import shutil

    shutil.copytree(demo["r8"], tmp_path / "checkpoint")
    shutil.copytree(demo["s8_dir"], tmp_path / "strategy")
    proc = run("show", str(tmp_path / "checkpoint"), EMBEDDING)
    assert proc.returncode == 0, proc.stderr
    assert "no --strategy given: using" in proc.stderr and "stage 1 (ranks 4-7)" in proc.stdout
    assert proc.stdout == run("show", demo["r8"], EMBEDDING, "--strategy", demo["s8"]).stdout
