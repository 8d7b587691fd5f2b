"""The README's guides run as written on the demo's files, and do what they say.

Every guide under "## Guides" with a ``bash`` block is run, in order, in ONE folder holding only
``demo`` (what ``reshard demo --dir demo`` wrote), with ``reshard`` meaning this checkout's command,
as a reader following them one after the other would; no two guides may write the same output.
Each guide's outputs are then checked. The README keeps its first two commands first, stays short,
lists what the demo makes, and its links land on real files and headings.
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
    "MindFormers 2.x",
    "Seeing a checkpoint",
)
WRITING = ("transform", "convert", "unify", "split")


def _guides() -> dict[str, str]:
    """``{heading: text}`` of every guide."""
    parts = re.split(r"^### (.+)$", GUIDES, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _block(title: str) -> str:
    text = _guides()[title]
    start = text.index("```bash\n") + len("```bash\n")
    return text[start : text.index("```", start)]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def check_links(page: Path) -> None:
    """Every relative link of ``page`` names a file that exists, and its ``#anchor`` a heading there."""
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} names no file"
        if fragment and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), flags=re.M)
            assert fragment in {anchor(h) for h in headings}, f"{page.name}: {target} names no heading"


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


def run_block(block: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """``block`` run by bash in ``folder``, ``reshard`` meaning this checkout's command; it must succeed."""
    script = block.replace("reshard ", f"{sys.executable} -m reshard ")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=folder, capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def ran(demo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The one folder every guide ran in, and each guide's stdout."""
    folder = tmp_path_factory.mktemp("guides")
    (folder / "demo").symlink_to(demo_root)
    return folder, {title: run_block(_block(title), folder).stdout for title in RUNNABLE}


def test_the_first_two_commands_stay_first() -> None:
    first = README.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first[0].startswith("python3 -m pip install -e . && reshard demo")
    assert "python3 -m pytest" in first[1]
    assert README.index("## Guides") > README.index("```bash\n")


def test_the_readme_is_short() -> None:
    assert len(README.splitlines()) <= 350


def test_the_readme_lists_what_the_demo_makes(demo_root: Path) -> None:
    listed = set(re.findall(r"`demo/([^`/]+)", README.split("\n## The demo\n", 1)[1].split("\n## ", 1)[0]))
    made = {p.name for p in demo_root.iterdir()}
    assert listed == made, (sorted(made - listed), sorted(listed - made))


def test_the_guides_are_there() -> None:
    assert list(_guides()) == list(RUNNABLE)
    assert "<!-- guide:" not in README  # no placeholder left


def test_links_land_on_files_and_headings() -> None:
    assert re.findall(r"\]\((docs/[^)]+)\)", GUIDES)  # the guides point to the details
    check_links(ROOT / "README.md")


def test_no_two_guides_write_the_same_output() -> None:
    """Each output a guide's command names (``--dst``, a convert/unify/split DST, ``-o``) is new."""
    written: dict[str, str] = {}
    for title in RUNNABLE:
        for command in re.split(r"\n(?!\s)|&&", _block(title).replace("\\\n", " ")):
            words = command.split("#", 1)[0].split()
            if "reshard" not in words:
                continue
            words = words[words.index("reshard") :]  # after an environment assignment
            outs = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--dst", "-o")]
            if len(words) > 3 and words[1] in (*WRITING, "plan") and not words[3].startswith("-"):
                outs.append(words[3])
            for out in outs:
                assert written.setdefault(out, title) == title, f"{out}: {written[out]} and {title}"
    assert len(written) >= 15


def test_merge_for_inference(ran: tuple[Path, dict[str, str]]) -> None:
    folder, out = ran
    assert (folder / "full" / "rank_0" / "checkpoint_0.ckpt").is_file()
    assert (folder / "full_st" / "rank_0" / "checkpoint_0.safetensors").is_file()
    assert (folder / "hf" / "model.safetensors.index.json").is_file()
    assert out["Merge for inference"].count("SAME: 119 match") == 1  # the full model, optimizer states included
    assert out["Merge for inference"].count("SAME: 39 match") == 1  # --hf: the model weights only


def test_hugging_face_export_with_a_preset(ran: tuple[Path, dict[str, str]]) -> None:
    import json

    from reshard.formats.safetensors import read_safetensors

    folder, out = ran
    entries = read_safetensors(str(folder / "hf_llama" / "model.safetensors")).entries
    names = set(entries)
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.embed_tokens.weight" in names
    assert not any(n.startswith(("adam_", "global_step", "learning_rate")) for n in names)
    assert {e.dtype.ms_name for e in entries.values()} == {"BFloat16"}
    assert json.loads((folder / "hf_llama" / "config.json").read_text())["model_type"] == "llama"
    report = json.loads((folder / "names.json").read_text())
    assert report["counts"]["renamed"] == 39 and report["counts"]["dropped"] == 80
    assert "SAME: 39 match" in out["Hugging Face export with a preset"]


def test_reshard_for_a_new_cluster(ran: tuple[Path, dict[str, str]]) -> None:
    folder, out = ran
    assert out["Reshard for a new cluster"].splitlines()[0] == "0 2 4 6"  # what the comment says
    assert sorted(p.name for p in (folder / "ckpt_4").iterdir() if p.is_dir()) == [f"rank_{r}" for r in range(4)]
    assert "SAME: 119 match" in out["Reshard for a new cluster"]


def test_encrypted_weights(ran: tuple[Path, dict[str, str]]) -> None:
    from reshard.sources import is_encrypted

    folder, out = ran
    assert all(is_encrypted(str(p)) for p in (folder / "enc_8ranks").glob("rank_*/*.ckpt"))
    assert all(is_encrypted(str(p)) for p in (folder / "enc_4").glob("rank_*/*.ckpt"))
    assert len(list((folder / "enc_4").glob("rank_*/*.ckpt"))) == 4
    assert len(list((folder / "plain_4").glob("rank_*/*.safetensors"))) == 4
    assert "SAME: 119 match" in out["Encrypted weights"]
    assert (folder / "weights.key").stat().st_mode & 0o777 == 0o600


def test_a_node_without_a_shared_disk(ran: tuple[Path, dict[str, str]]) -> None:
    folder, out = ran
    assert sorted(p.name for p in (folder / "node0" / "ckpt").iterdir()) == ["rank_0", "rank_2", "rank_4"]
    assert [p.name for p in (folder / "node0" / "out").iterdir() if p.is_dir()] == ["rank_0"]
    assert "SAME: 59 match" in out["A node without a shared disk"]


def test_mindformers_2x(ran: tuple[Path, dict[str, str]]) -> None:
    import json

    folder, out = ran
    assert (folder / "demo" / "mf2_8ranks" / "latest_checkpointed_iteration.txt").read_text() == "1000"
    assert (folder / "mf2" / "latest_checkpointed_iteration.txt").read_text() == "1000"
    assert (folder / "mf2_4" / "latest_checkpointed_iteration.txt").read_text() == "1000"  # carried over
    assert sorted(p.name for p in (folder / "mf2_4" / "iteration_00001000").glob("model-*")) == [
        f"model-{r:07d}-0000004.safetensors" for r in range(4)
    ]
    metadata = json.loads((folder / "mf2" / "iteration_00001000" / "metadata.json").read_text())
    assert set(metadata) == {"state_dict_metadata", "storage_data"}
    assert (folder / "mf2_full" / "rank_0" / "checkpoint_0.safetensors").is_file()
    assert (folder / "mf2_hf" / "model.safetensors.index.json").is_file()
    assert out["MindFormers 2.x"].count("SAME") == 2


def test_seeing_a_checkpoint(ran: tuple[Path, dict[str, str]]) -> None:
    folder, out = ran
    shown = out["Seeing a checkpoint"]
    for line in re.findall(r"^#   (.+)$", _block("Seeing a checkpoint"), flags=re.M):
        assert line == "..." or line in shown, line  # the output the block shows is the output
    assert "model.layers.0.attention.wq.weight" in shown
    assert "<svg" in (folder / "emb.svg").read_text()
    assert "<svg" in (folder / "plan.svg").read_text()
    assert not (folder / "plan_4").exists()  # plan writes nothing but its picture
