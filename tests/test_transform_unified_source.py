"""transform reads a unify output (part files + param_name_map.json) as the full model it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard import api
from tests.trust_helpers import make_job, run_cli


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("job"))
    job = make_job(root)
    api.unify(job["r8st"], job["s8"], f"{root}/unified", destination=api.Destination(manifest=False))
    job["unified"] = f"{root}/unified"
    return job


@pytest.mark.parametrize("fmt", ["safetensors", "ckpt", "checkpoint2"])
def test_unified_to_four_ranks(job: dict[str, str], tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "out"
    proc = run_cli(
        "transform", "--src", job["unified"], "--dst", str(out), "--dst-strategy", job["s4"], "--output-format", fmt
    )
    assert proc.returncode == 0, proc.stderr
    check = ["verify", str(out), job["full"]] + ([] if fmt == "checkpoint2" else ["--a-strategy", job["s4"]])
    proc = run_cli(*check)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_unified_with_a_source_strategy_is_refused(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("transform", "--src", job["unified"], "--src-strategy", job["s8"], "--dst", str(out))
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("a unified model is a full model: give no source strategy")
    assert not out.exists()
