"""The drop-in at full speed: MindSpore's process counts are checked, never used as thread counts.

``transform_checkpoints(process_num=1)`` (MindSpore's default) once ran reshard's IO on a single
thread, measurably slower than the CLI on the same job. Every drop-in function taking a process
count now runs with the CLI's default worker count, whatever the count says; counts MindSpore
cannot run with (below 1, not an int) are still one-line ``UsageError``s.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from reshard import api, layout
from reshard import mindspore as ms
from reshard.errors import UsageError
from reshard.execute.options import RunOptions, default_workers
from reshard.formats.ckpt import save_ckpt
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout as L

W = np.arange(64, dtype=np.float32).reshape(8, 8)


@pytest.fixture
def job(tmp_path: Any) -> dict[str, str]:
    """A 2-rank .ckpt and .safetensors source, its strategy, a unified folder and a 4-rank strategy."""
    s2, s4 = str(tmp_path / "s2.ckpt"), str(tmp_path / "s4.ckpt")
    write_strategy(s2, make_strategy({"w": L((2,), (0, -1))}))
    write_strategy(s4, make_strategy({"w": L((2, 2), (1, 0))}))
    for rank in range(2):
        box = layout.rank_box(L((2,), (0, -1)), W.shape, rank)
        piece = np.ascontiguousarray(W[tuple(slice(a, b) for a, b in box)])
        save_ckpt(str(tmp_path / "ck" / f"rank_{rank}" / f"c_{rank}.ckpt"), {"w": piece})
    api.convert(str(tmp_path / "ck"), str(tmp_path / "st"), "safetensors")
    api.unify(str(tmp_path / "st"), s2, str(tmp_path / "unified"))
    return {
        "s2": s2,
        "s4": s4,
        "ck": str(tmp_path / "ck"),
        "st": str(tmp_path / "st"),
        "unified": str(tmp_path / "unified"),
        "out": str(tmp_path / "out"),
    }


@pytest.fixture
def seen_workers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Worker counts of every run the drop-in starts (recorded at ``reshard.ops.run.execute``, the one run path's)."""
    from reshard.ops import run as run_path

    seen: list[int] = []
    real = run_path.execute

    def recording(plan: Any, *, run: RunOptions | None = None, **kwargs: Any) -> Any:
        seen.append(run.workers if run is not None else -1)
        return real(plan, run=run, **kwargs)

    monkeypatch.setattr(run_path, "execute", recording)
    return seen


def _calls(j: dict[str, str]) -> dict[str, Any]:
    """Each drop-in function with a process count, as a function of that count."""
    return {
        "transform_checkpoints": lambda n: ms.transform_checkpoints(
            j["ck"], j["out"], "p_", j["s2"], j["s4"], process_num=n
        ),
        "transform_checkpoints (safetensors)": lambda n: ms.transform_checkpoints(
            j["st"], j["out"], "p_", j["s2"], j["s4"], process_num=n, output_format="safetensors"
        ),
        "ckpt_to_safetensors": lambda n: ms.ckpt_to_safetensors(j["ck"], j["out"], processes_num=n),
        "safetensors_to_ckpt": lambda n: ms.safetensors_to_ckpt(j["st"], j["out"], processes_num=n),
        "unified_safetensors": lambda n: ms.unified_safetensors(j["st"], j["s2"], j["out"], max_process_num=n),
        "load_distributed_checkpoint": lambda n: ms.load_distributed_checkpoint(
            None,
            format="safetensors",
            predict_strategy=j["s4"],
            unified_safetensors_dir=j["unified"],
            dst_safetensors_dir=j["out"],
            max_process_num=n,
        ),
    }


@pytest.mark.parametrize("count", [1, 2, 64])
@pytest.mark.parametrize("function", list(_calls({k: "" for k in ("ck", "st", "s2", "s4", "unified", "out")})))
def test_process_counts_do_not_size_the_io(
    job: dict[str, str], seen_workers: list[int], function: str, count: int
) -> None:
    _calls(job)[function](count)
    assert seen_workers and set(seen_workers) == {default_workers()}
    assert os.listdir(job["out"])


@pytest.mark.parametrize("count", [0, -1, True, 2.5, "2", None])
@pytest.mark.parametrize("function", ["transform_checkpoints", "ckpt_to_safetensors", "unified_safetensors"])
def test_process_counts_mindspore_cannot_run_with_are_usage_errors(
    job: dict[str, str], function: str, count: Any
) -> None:
    with pytest.raises(UsageError, match="process"):
        _calls(job)[function](count)
    assert not os.path.exists(job["out"])
