"""The README's MindFormers 2.x commands run as written on the demo's files, and give the right trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADING = "### MindFormers 2.x (Checkpoint 2.0)"


def _block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index(HEADING) :]
    start = section.index("```bash\n") + len("```bash\n")
    return section[start : section.index("```", start)]


def test_readme_mindformers_block_runs_on_the_demo(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    demo = subprocess.run(
        [sys.executable, "-m", "reshard", "demo", "--dir", "demo"], cwd=tmp_path, capture_output=True, text=True
    )
    assert demo.returncode == 0, demo.stderr
    assert (tmp_path / "demo" / "mf2_8ranks" / "latest_checkpointed_iteration.txt").read_text() == "1000"
    script = _block().replace("reshard ", f"{sys.executable} -m reshard ")
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "mf2" / "latest_checkpointed_iteration.txt").read_text() == "1000"
    assert (tmp_path / "mf2_4" / "latest_checkpointed_iteration.txt").read_text() == "1000"  # carried over
    assert sorted(p.name for p in (tmp_path / "mf2_4" / "iteration_00001000").glob("model-*")) == [
        f"model-{r:07d}-0000004.safetensors" for r in range(4)
    ]
    metadata = json.loads((tmp_path / "mf2" / "iteration_00001000" / "metadata.json").read_text())
    assert set(metadata) == {"state_dict_metadata", "storage_data"}
    assert (tmp_path / "merged" / "rank_0" / "checkpoint_0.safetensors").is_file()
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert "SAME" in proc.stdout
