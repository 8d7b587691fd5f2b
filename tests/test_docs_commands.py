"""The commands of the ``docs/`` pages run as written on the demo's files, and their links land.

Each page below has its ``bash`` and ``python`` blocks run in order in one folder of its own holding
only ``demo`` (what ``reshard demo --dir demo`` wrote), ``reshard`` meaning this checkout's command.
A page with a runnable block must be listed here or say where else it is run (``ELSEWHERE``), so a
new page's commands cannot go untested. Blocks a test machine cannot run (a Ray cluster) are
``text`` blocks. Every relative link of every page names a real file and heading.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reshard import cli
from tests.test_teach_readme import check_links, run_block

DOCS = Path(__file__).resolve().parent.parent / "docs"
RUN = {  # page -> the part of it whose blocks run (None: all of it)
    "checkpoint2.md": "## Some ranks on a node without a shared disk",
    "hugging-face.md": None,
    "megatron-names.md": "## Try it",
    "ray.md": None,
    "python-api.md": None,
    "low-precision.md": "## 8. Try it",
    "pytorch.md": "## Writing",
}
ELSEWHERE = {
    "job-start.md": "tests/test_auto_job_start_page.py runs its wrapper on 4 ranks",
    "testing.md": "its one command is the README's second",
    "benchmarks.md": "the benchmarks take minutes; tests/test_scale_plan.py and test_scale_big_run.py smoke-test them",
}
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```$", re.M | re.S)


def _blocks(page: str) -> list[tuple[str, str]]:
    text = (DOCS / page).read_text(encoding="utf-8")
    section = RUN.get(page)
    if section is not None:
        text = text.split(f"\n{section}\n", 1)[1].split("\n## ", 1)[0]
    return BLOCK.findall(text)


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("docs-demo")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert cli.main(["demo", "--dir", "demo"]) == 0
    finally:
        os.chdir(cwd)
    return root / "demo"


def _run_page(page: str, demo_root: Path, folder: Path) -> str:
    """Stdout of every block of ``page``, run in order in ``folder``."""
    (folder / "demo").symlink_to(demo_root)
    out = []
    for language, block in _blocks(page):
        if language == "python":
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            proc = subprocess.run(
                [sys.executable, "-c", block], cwd=folder, capture_output=True, text=True, env=env, timeout=600
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            proc = run_block(block, folder)
        out.append(proc.stdout)
    return "".join(out)


def test_every_page_with_commands_is_run() -> None:
    with_commands = {p.name for p in DOCS.glob("*.md") if BLOCK.search(p.read_text(encoding="utf-8"))}
    assert with_commands <= set(RUN) | set(ELSEWHERE), sorted(with_commands - set(RUN) - set(ELSEWHERE))
    assert all(_blocks(page) for page in RUN)


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_links_land(page: str) -> None:
    check_links(DOCS / page)


def test_checkpoint2_some_ranks_on_a_node(demo_root: Path, tmp_path: Path) -> None:
    """The copy of what rank-list --files names (tensor files and the texts) is enough for --ranks 0."""
    _run_page("checkpoint2.md", demo_root, tmp_path)
    copied = sorted(p.name for p in (tmp_path / "node1" / "demo" / "mf2_8ranks").rglob("*") if p.is_file())
    assert "metadata.json" in copied and "latest_checkpointed_iteration.txt" in copied and len(copied) < 19
    out = tmp_path / "node1" / "out" / "iteration_00001000"
    assert sorted(p.name for p in out.iterdir())[:3] == [
        "common.json",
        "metadata.json",
        "model-0000000-0000004.safetensors",
    ]


def test_hugging_face(demo_root: Path, tmp_path: Path) -> None:
    import json

    out = _run_page("hugging-face.md", demo_root, tmp_path)
    index = json.loads((tmp_path / "hf_unified" / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == 39 and len(set(index["weight_map"].values())) > 1  # cut at 2 MB
    assert (tmp_path / "hf_transformed" / "model.safetensors").is_file()
    assert (tmp_path / "hf_converted" / "model.safetensors").is_file()
    assert len(list((tmp_path / "hf_st_4ranks").glob("rank_*/*.safetensors"))) == 4
    assert len(list((tmp_path / "hf_ckpt_4ranks").glob("rank_*/*.ckpt"))) == 4
    assert "SAME: 39 match" in out


def test_ray_placement_plan(demo_root: Path, tmp_path: Path) -> None:
    out = _run_page("ray.md", demo_root, tmp_path)
    block = _blocks("ray.md")[0][1]
    shown = re.search(r"# \.\.\. (bytes across nodes: .+)$", block, flags=re.M)
    assert shown and shown.group(1) in out  # the number the page shows is the number
    assert not (tmp_path / "ray_4ranks").exists()  # a plan writes nothing


def test_python_api(demo_root: Path, tmp_path: Path) -> None:
    out = _run_page("python-api.md", demo_root, tmp_path)
    assert "'operation': 'transform'" in out and "(128, 128) float32" in out
    assert len(list((tmp_path / "py_4ranks").glob("rank_*/*.safetensors"))) == 4
    assert not (tmp_path / "py_full").exists()  # dry run
    assert sorted(p.name for p in (tmp_path / "py_split").iterdir() if p.is_dir()) == ["rank_0", "rank_1"]
    assert not (tmp_path / "py_hf" / "hyper_param.safetensors").exists()  # weights only
    assert len(list((tmp_path / "py_enc_4ranks").glob("rank_*/*.ckpt"))) == 4
    assert sorted(p.name for p in (tmp_path / "ms_4ranks").iterdir() if p.is_dir()) == [f"rank_{r}" for r in range(4)]


def test_pytorch_writing(demo_root: Path, tmp_path: Path) -> None:
    out = _run_page("pytorch.md", demo_root, tmp_path)
    for folder in ("dcp_8ranks", "dcp_rows3", "dcp_split4", "dcp_full", "dcp_bf16"):
        assert (tmp_path / folder / ".metadata").is_file(), folder
    assert len(list((tmp_path / "dcp_rows3").glob("__*_0.distcp"))) == 3
    assert "BFloat16 (128, 128)" in out and "__0_0.distcp" in out
    assert (tmp_path / "megatron_run" / "iter_0000100" / "metadata.json").is_file()
    assert "Megatron-core torch_dist checkpoint (2 data files)" in out and out.count("SAME: 119 match") == 2


def test_pytorch_reading_hand_made_dcp_loads_in_torch(demo_root: Path, tmp_path: Path) -> None:
    """The DCP folder "Reading with the commands" makes without torch: the block's commands run (its first
    line aside: the demo is there), and torch loads the folder as dcp_to_torch_save does, its step too
    (torch.save's bytes, handed to torch.load), every tensor equal to the demo's."""
    import json

    import numpy as np

    from reshard.sources import open_checkpoint
    from tests.torch_oracle import run_torch_script

    text = (DOCS / "pytorch.md").read_text(encoding="utf-8").split("\n## Reading with the commands\n", 1)[1]
    ((language, block),) = BLOCK.findall(text.split("\n## ", 1)[0])
    first, script, commands = re.fullmatch(r"(.*?)\npython - <<'PY'\n(.*?)\nPY\n(.*)", block, flags=re.S).groups()
    assert (language, first) == ("bash", "reshard demo --dir demo")
    (tmp_path / "demo").symlink_to(demo_root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = run_block(commands, tmp_path).stdout
    assert "SAME" in out and out.rstrip().endswith("__1_0.distcp")  # verify; rank-list --files last
    loaded = tmp_path / "loaded"
    run_torch_script("dcp_load.py", {"loads": [{"folder": str(tmp_path / "dcp_ckpt"), "out": str(loaded)}]})
    assert json.loads(loaded.with_suffix(".json").read_text()) == {"step": 100}
    tensors = np.load(loaded.with_suffix(".npz"))
    with open_checkpoint(str(demo_root / "full" / "model.ckpt")) as index:
        assert sorted(tensors.files) == sorted(index.entries)
        for name in index.entries:
            assert np.array_equal(tensors[name], np.array(index.array(name))), name


def test_low_precision_try_it(demo_root: Path, tmp_path: Path) -> None:
    _run_page("low-precision.md", demo_root, tmp_path)
    assert (tmp_path / "fp8_again" / "model.safetensors").is_file()
    assert (tmp_path / "fp8_py").is_dir()


def test_megatron_names_try_it(demo_root: Path, tmp_path: Path) -> None:
    out = _run_page("megatron-names.md", demo_root, tmp_path)
    assert (tmp_path / "megatron_dcp" / ".metadata").is_file()
    assert "9 model weights" in out  # the layers stacked: one tensor per kind of weight
    assert "SAME: 39 match, 0 differ" in out
    assert "('surgery', 14), ('unmatched', 0)" in out and (tmp_path / "py_hf" / "rank_0").is_dir()
    assert out.count("SAME: 39 match, 0 differ") == 2  # the Checkpoint 2.0 round trip too
