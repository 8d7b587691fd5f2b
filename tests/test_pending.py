"""``ops.pending``: a check of the inputs running beside the copy, waited for before outputs go into place."""

from __future__ import annotations

import threading

import pytest

from reshard.dtypes import FLOAT32
from reshard.errors import IntegrityError, UsageError
from reshard.execute.options import RayOptions, RunOptions
from reshard.ops.pending import PendingCheck, beside_the_copy, its_error_first
from reshard.plan import FilePlan, Plan, TensorPlan


def _failing() -> None:
    raise IntegrityError("copies differ", "rank_2")


def test_wait_returns_once_it_passed_and_raises_what_it_raised() -> None:
    release = threading.Event()
    check = PendingCheck(release.wait)
    release.set()
    check.wait()
    assert check.failed() is None
    failing = PendingCheck(_failing)
    with pytest.raises(IntegrityError, match="copies differ"):
        failing.wait()
    with pytest.raises(IntegrityError):  # again, for every output that waits
        failing.wait()
    assert isinstance(failing.failed(), IntegrityError)


def test_gated_runs_start_it_with_their_first_tensor_and_wait_for_it_before_their_own_hook() -> None:
    calls: list[str] = []
    release = threading.Event()

    def check() -> None:
        release.wait()
        calls.append("check")

    pending = PendingCheck(check)
    run = RunOptions(
        workers=3, progress=lambda n: calls.append(f"copied {n}"), before_commit=lambda: calls.append("own")
    )
    gated = pending.gated(run)
    assert gated.workers == 3 and gated.progress is not None and gated.before_commit is not None
    assert not pending._thread.is_alive()  # not before the copy copies
    gated.progress(10)
    assert pending._thread.is_alive()
    gated.progress(20)  # started once
    release.set()
    gated.before_commit()
    assert calls == ["copied 10", "copied 20", "check", "own"]
    assert PendingCheck(lambda: None).gated(None).before_commit is not None


def test_a_check_nothing_started_runs_when_waited_for() -> None:
    calls: list[str] = []
    PendingCheck(lambda: calls.append("check")).wait()
    assert calls == ["check"]


def test_a_ray_run_gets_the_verdict_at_once() -> None:
    ray = RayOptions()
    assert PendingCheck(lambda: None).gated(ray) is ray
    with pytest.raises(IntegrityError):
        PendingCheck(_failing).gated(ray)


def test_its_error_wins_over_the_blocks_own() -> None:
    with pytest.raises(IntegrityError), its_error_first(PendingCheck(_failing)):
        raise UsageError("the destination is not empty", "out")
    with pytest.raises(UsageError), its_error_first(PendingCheck(lambda: None)):
        raise UsageError("the destination is not empty", "out")
    with pytest.raises(UsageError), its_error_first(None):
        raise UsageError("the destination is not empty", "out")
    with its_error_first(PendingCheck(_failing)):
        pass  # no error in the block: the check's comes when someone waits


def _plan_of(*sizes: int) -> Plan:
    files = tuple(
        FilePlan(f"out/rank_{k}/m.ckpt", "ckpt", (TensorPlan(f"t{k}", FLOAT32, (n // 4,), (), n),))
        for k, n in enumerate(sizes)
    )
    return Plan("transform", (), files)


@pytest.mark.parametrize(
    ("sizes", "beside"),
    [((1000,), True), ((1000, 10), True), ((500, 500), False), ((300, 300, 300, 300), False), ((), False)],
)
def test_it_runs_beside_a_copy_into_one_file_only(sizes: tuple[int, ...], beside: bool) -> None:
    assert beside_the_copy(_plan_of(*sizes)) is beside
