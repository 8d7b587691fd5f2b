"""The README's guides run as written on the demo's files, and do what they say.

Each guide under "## Guides" with a ``bash`` block is run in a fresh folder holding only ``demo``
(what ``reshard demo --dir demo`` wrote), with ``reshard`` meaning this checkout's command; its
outputs are then checked. The README keeps its first two commands first and links that land on
real headings.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reshard import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
GUIDES = README.split("\n## Guides\n", 1)[1].split("\n## ", 1)[0]
RUNNABLE = (
    "Merge for inference",
    "Hugging Face export with a preset",
    "Reshard for a new cluster",
    "Encrypted weights",
    "A node without a shared disk",
)


def _guides() -> dict[str, str]:
    """``{heading: text}`` of every guide."""
    parts = re.split(r"^### (.+)$", GUIDES, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _block(title: str) -> str:
    text = _guides()[title]
    start = text.index("```bash\n") + len("```bash\n")
    return text[start : text.index("```", start)]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("teach-readme")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert cli.main(["demo", "--dir", "demo"]) == 0
    finally:
        os.chdir(cwd)
    return root / "demo"


def _run_guide(title: str, demo_root: Path, folder: Path) -> subprocess.CompletedProcess[str]:
    (folder / "demo").symlink_to(demo_root)
    script = _block(title).replace("reshard ", f"{sys.executable} -m reshard ")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=folder, capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_first_two_commands_stay_first() -> None:
    first = README.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first[0].startswith("python3 -m pip install -e . && reshard demo")
    assert "python3 -m pytest" in first[1]
    assert README.index("## Guides") > README.index("```bash\n")


def test_hugging_face_export_with_a_preset(demo_root: Path, tmp_path: Path) -> None:
    import json

    from reshard.formats.safetensors import read_safetensors

    proc = _run_guide("Hugging Face export with a preset", demo_root, tmp_path)
    entries = read_safetensors(str(tmp_path / "hf_llama" / "model.safetensors")).entries
    names = set(entries)
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.embed_tokens.weight" in names
    assert not any(n.startswith(("adam_", "global_step", "learning_rate")) for n in names)
    assert {e.dtype.ms_name for e in entries.values()} == {"BFloat16"}
    assert json.loads((tmp_path / "hf_llama" / "config.json").read_text())["model_type"] == "llama"
    report = json.loads((tmp_path / "names.json").read_text())
    assert report["counts"]["renamed"] == 39 and report["counts"]["dropped"] == 80
    assert "SAME: 39 match" in proc.stdout


def test_the_guides_are_there() -> None:
    titles = list(_guides())
    assert titles[: len(RUNNABLE)] == list(RUNNABLE) and "MindFormers 2.x" in titles
    assert "<!-- guide:" not in README  # no placeholder left


def test_links_of_the_guides_land_on_headings() -> None:
    headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", README, flags=re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", GUIDES)
    assert links and set(links) <= headings, set(links) - headings


def test_merge_for_inference(demo_root: Path, tmp_path: Path) -> None:
    proc = _run_guide("Merge for inference", demo_root, tmp_path)
    assert (tmp_path / "full" / "rank_0" / "checkpoint_0.ckpt").is_file()
    assert (tmp_path / "full_st" / "rank_0" / "checkpoint_0.safetensors").is_file()
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert proc.stdout.count("SAME: 119 match") == 1  # the full model, optimizer states included
    assert proc.stdout.count("SAME: 39 match") == 1  # --hf: the model weights only


def test_reshard_for_a_new_cluster(demo_root: Path, tmp_path: Path) -> None:
    proc = _run_guide("Reshard for a new cluster", demo_root, tmp_path)
    assert proc.stdout.splitlines()[0] == "0 2 4 6"  # what the comment says
    assert sorted(p.name for p in (tmp_path / "ckpt_4").iterdir() if p.is_dir()) == [f"rank_{r}" for r in range(4)]
    assert "SAME: 119 match" in proc.stdout


def test_encrypted_weights(demo_root: Path, tmp_path: Path) -> None:
    from reshard.sources import is_encrypted

    proc = _run_guide("Encrypted weights", demo_root, tmp_path)
    assert all(is_encrypted(str(p)) for p in (tmp_path / "enc_8ranks").glob("rank_*/*.ckpt"))
    assert all(is_encrypted(str(p)) for p in (tmp_path / "enc_4").glob("rank_*/*.ckpt"))
    assert len(list((tmp_path / "enc_4").glob("rank_*/*.ckpt"))) == 4
    assert len(list((tmp_path / "plain_4").glob("rank_*/*.safetensors"))) == 4
    assert "SAME: 119 match" in proc.stdout
    assert (tmp_path / "weights.key").stat().st_mode & 0o777 == 0o600


def test_a_node_without_a_shared_disk(demo_root: Path, tmp_path: Path) -> None:
    proc = _run_guide("A node without a shared disk", demo_root, tmp_path)
    assert sorted(p.name for p in (tmp_path / "node0" / "ckpt").iterdir()) == ["rank_0", "rank_2", "rank_4"]
    assert [p.name for p in (tmp_path / "node0" / "out").iterdir() if p.is_dir()] == ["rank_0"]
    assert "SAME: 59 match" in proc.stdout
