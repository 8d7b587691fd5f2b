"""The operations' shared pieces (issue 20): one run path, output formats checked by name.

Every operation (and the drop-in's conversions) ends in ``reshard.ops.run.run_plans``; an output
format that does not exist, or one an operation does not write, is one ``UsageError`` naming the
choices, before anything is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from reshard import api
from reshard import mindspore as ms
from reshard.errors import UsageError
from reshard.ops import run as run_path


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reshard import demo as make_demo

    folder = tmp_path_factory.mktemp("ops") / "demo"
    make_demo.main(str(folder))
    return folder


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The roots of every run that goes through the one run path."""
    seen: list[str] = []
    real = run_path.run_plans

    def recording(plans: Any, target: run_path.Target, *args: Any, **kwargs: Any) -> list[str]:
        seen.append(str(target.root or target.output_file))
        return real(plans, target, *args, **kwargs)

    monkeypatch.setattr(run_path, "run_plans", recording)
    return seen


def test_every_operation_runs_through_the_one_run_path(demo: Path, tmp_path: Path, runs: list[str]) -> None:
    d = str(demo)
    api.transform(f"{d}/ckpt_8ranks", str(tmp_path / "t"), f"{d}/strategy_8", f"{d}/strategy_4")
    api.unify(f"{d}/st_8ranks", f"{d}/strategy_8", str(tmp_path / "u"))
    api.split(str(tmp_path / "u"), f"{d}/strategy_4", str(tmp_path / "s"), ranks=[0])
    api.convert(f"{d}/full/model.ckpt", str(tmp_path / "c"), "safetensors")
    files = {r: f"{d}/ckpt_8ranks/rank_{r}/checkpoint_{r}.ckpt" for r in api.needed_ranks(0, f"{d}/strategy_8")}
    api.transform_by_rank(0, files, str(tmp_path / "r" / "checkpoint_0.ckpt"), f"{d}/strategy_8")
    ms.unified_safetensors(f"{d}/st_8ranks", f"{d}/merged/src_strategy.ckpt", str(tmp_path / "mu"))
    ms.transform_checkpoints(
        f"{d}/ckpt_8ranks", str(tmp_path / "mt"), "p_", f"{d}/merged/src_strategy.ckpt", f"{d}/merged/dst_strategy.ckpt"
    )
    assert runs == [str(tmp_path / n) for n in ("t", "u", "s", "c")] + [
        str(tmp_path / "r" / "checkpoint_0.ckpt"),
        str(tmp_path / "mu"),
        str(tmp_path / "mt"),
    ]


def test_a_dry_run_never_reaches_the_run_path(demo: Path, tmp_path: Path, runs: list[str]) -> None:
    dry = api.Destination(dry_run=True)
    report = api.transform(f"{demo}/ckpt_8ranks", str(tmp_path / "t"), f"{demo}/strategy_8", None, destination=dry)
    assert report.plan.files and runs == [] and not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda d, o: api.transform(f"{d}/ckpt_8ranks", o, f"{d}/strategy_8", None, output=api.OutputSpec("npy")),
            r"unknown output format 'npy' \(choose ckpt, safetensors, hf, checkpoint2, dcp or torch_dist\)",
        ),
        (
            lambda d, o: api.unify(f"{d}/st_8ranks", f"{d}/strategy_8", o, output=api.OutputSpec("ckpt")),
            r"unify writes safetensors, hf, dcp or torch_dist, not 'ckpt'",
        ),
        (
            lambda d, o: api.split(f"{d}/full", f"{d}/strategy_4", o, output=api.OutputSpec("checkpoint2")),
            r"split writes safetensors, ckpt, dcp or torch_dist, not 'checkpoint2'",
        ),
        (
            lambda d, o: api.convert(f"{d}/full/model.ckpt", o, "npy"),
            r"--to must be ckpt, safetensors, dcp or torch_dist, not 'npy'",
        ),
        (
            lambda d, o: api.transform(
                f"{d}/ckpt_8ranks", o, f"{d}/strategy_8", None, output=api.OutputSpec(max_shard_size="1GB")
            ),
            r"a maximum shard size needs Hugging Face output",
        ),
    ],
)
def test_an_output_format_an_operation_does_not_write_is_refused(
    demo: Path, tmp_path: Path, call: Any, message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        call(str(demo), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
