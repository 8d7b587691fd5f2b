"""The wrapper of ``docs/job-start.md`` runs as written: 4 ranks, a stand-in ``run_mindformer.py``.

The stand-in records its arguments; each rank must have been handed the cache entry as
``--load_checkpoint`` (the same folder on every rank, holding ``rank_<its rank>/checkpoint_<r>.ckpt``)
and ``--auto_trans_ckpt False``, and the entry must hold what an offline transform writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from reshard import api
from reshard.formats.ckpt import save_ckpt
from reshard.formats.strategy import write_strategy
from reshard.synthetic import ModelShape, full_model, stage_strategies

ROOT = Path(__file__).resolve().parent.parent
SHAPE = ModelShape(vocab=64, hidden=32, ffn=64, layers=2)

STAND_IN = """
import json, os, sys
args = sys.argv[1:]
with open(os.path.join("ran", os.environ["RANK_ID"] + ".json"), "w") as fh:
    json.dump(args, fh)
"""


def _wrapper() -> str:
    section = (ROOT / "docs" / "job-start.md").read_text(encoding="utf-8")
    start = section.index("#!/usr/bin/env bash\n")
    return section[start : section.index("```", start)]


def test_the_pages_wrapper_starts_every_rank_from_the_cache(tmp_path: Path) -> None:
    full = tmp_path / "model.ckpt"
    save_ckpt(str(full), full_model(SHAPE))
    strategy = tmp_path / "output" / "strategy"
    strategy.mkdir(parents=True)
    layout = stage_strategies(SHAPE, dp=2, mp=2, pp=1, opt_shard=True)[0]
    for rank in range(4):
        write_strategy(strategy / f"ckpt_strategy_rank_{rank}.ckpt", layout)
    (tmp_path / "start_rank.sh").write_text(_wrapper().replace("reshard ", f"{sys.executable} -m reshard "))
    (tmp_path / "run_mindformer.py").write_text(STAND_IN)
    (tmp_path / "ran").mkdir()
    procs = []
    for rank in range(4):
        env = {**os.environ, "RANK_ID": str(rank), "RANK_SIZE": "4", "RESHARD_CACHE": str(tmp_path / "cache")}
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        procs.append(
            subprocess.Popen(
                ["bash", "start_rank.sh", "job.yaml", str(full), "--run_mode", "finetune"],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    reference = tmp_path / "reference"
    api.transform(str(full), str(reference), None, str(strategy))
    entries = set()
    for rank in range(4):
        args = json.loads((tmp_path / "ran" / f"{rank}.json").read_text())
        assert args[:2] == ["--config", "job.yaml"] and args[-4:] == [
            "--auto_trans_ckpt",
            "False",
            "--run_mode",
            "finetune",
        ]
        entry = Path(args[args.index("--load_checkpoint") + 1])
        entries.add(entry)
        name = f"rank_{rank}/checkpoint_{rank}.ckpt"
        assert (entry / name).read_bytes() == (reference / name).read_bytes()
    assert len(entries) == 1
    log = (next(iter(entries)) / "conversions.log").read_text().splitlines()
    assert sorted(json.loads(line)["rank"] for line in log) == [0, 1, 2, 3]


def test_docstring_sections_and_example_on_the_demo(tmp_path: Path, monkeypatch) -> None:
    """``auto_transform``'s docstring as tests/test_public_surface.py checks ``api``'s: sections, every
    parameter under Args, and an Example that runs on ``reshard demo``'s files."""
    import inspect
    import textwrap

    from reshard import demo
    from reshard.auto import auto_transform

    doc = inspect.cleandoc(auto_transform.__doc__ or "")
    lines = doc.splitlines()
    at = [lines.index(s) for s in ("Args:", "Returns:", "Raises:", "Example:")]
    assert at == sorted(at)
    args = "\n".join(lines[at[0] + 1 : at[1]])
    for name in inspect.signature(auto_transform).parameters:
        assert f"    {name}: " in args, name
    demo.main(str(tmp_path / "demo"))
    monkeypatch.chdir(tmp_path)
    exec(compile(textwrap.dedent("\n".join(lines[at[3] + 1 :])), "<auto_transform example>", "exec"), {})
    assert (tmp_path / "cache").is_dir()
