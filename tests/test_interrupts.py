"""``reshard.interrupts`` in this process: the command's handlers come and go with the command, and
the Python API (the operations, the MindSpore drop-ins) keeps Python's own signal semantics: a
Ctrl-C inside a call is a plain ``KeyboardInterrupt`` raised to the caller, after the same clean-up
the command gets (no temporary file, the finished outputs journaled)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from reshard import api, cli, interrupts, manifest
from reshard.execute.options import RunOptions
from reshard.mindspore import dropin
from tests.trust_helpers import make_job, temp_files


def _handlers() -> dict[int, Any]:
    return {s: signal.getsignal(s) for s in interrupts.STOP_SIGNALS}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("intr")))


def test_handling_installs_and_restores() -> None:
    before = _handlers()
    with interrupts.handling():
        installed = [s for s in interrupts.STOP_SIGNALS if before[s] is not signal.SIG_IGN]
        assert all(signal.getsignal(s) is not before[s] for s in installed)
        with interrupts.handling():  # nested (cli.main inside reshard.entry): changes nothing
            pass
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    assert _handlers() == before


def test_a_signal_raises_signalled_and_ignores_the_next_until_the_block_ends() -> None:
    before = _handlers()
    with pytest.raises(interrupts.Signalled) as caught, interrupts.handling():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert caught.value.signum == signal.SIGTERM and isinstance(caught.value, KeyboardInterrupt)
    assert _handlers() == before


def test_cli_main_in_process_leaves_the_handlers_as_it_found_them(tmp_path) -> None:
    before = _handlers()
    assert cli.main(["inspect", str(tmp_path / "missing")]) == 2
    assert _handlers() == before


def test_the_api_leaves_the_handlers_alone(job: dict[str, str], tmp_path) -> None:
    before = _handlers()
    dropin.ckpt_to_safetensors(job["full"], str(tmp_path / "st"))
    api.transform(job["r8"], str(tmp_path / "r4"), job["s8"], job["s4"])
    assert _handlers() == before
    if before[signal.SIGINT] is not signal.SIG_IGN:  # a suite run in the background inherits SIGINT ignored
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_inside_an_api_call_is_a_plain_keyboard_interrupt(
    job: dict[str, str], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker, dst = str(tmp_path / "marker"), str(tmp_path / "out")
    monkeypatch.setenv(interrupts.MARKER_ENV, marker)
    monkeypatch.setattr(interrupts, "_PAUSE", ("file", 2))  # as RESHARD_TEST_PAUSE_AT=file:2 would

    def ctrl_c_once_paused() -> None:
        while not os.path.exists(marker):
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own Ctrl-C handler, as in a terminal (a suite run in the background inherits SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=ctrl_c_once_paused, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt) as caught:  # one worker: the main thread is the one paused
            api.transform(job["r8"], dst, job["s8"], job["s4"], run=RunOptions(workers=1))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert type(caught.value) is KeyboardInterrupt
    progress = getattr(caught.value, manifest.PROGRESS_ATTRIBUTE)
    assert (progress.completed, progress.total, progress.complete) == (1, 4, False)
    assert not temp_files(dst) and len(manifest.read_journal(dst)) == 1


@pytest.mark.parametrize(
    ("text", "spec"),
    [("file", ("file", 1)), ("file:16", ("file", 16)), ("import:numpy", ("import:numpy", 1)), ("", None)],
)
def test_pause_specs(text: str, spec: tuple[str, int] | None) -> None:
    assert interrupts._spec(text) == spec


def test_every_pause_point_is_documented() -> None:
    import pathlib
    import re

    src = pathlib.Path(interrupts.__file__).parent
    used = set()
    for path in src.rglob("*.py"):
        used.update(re.findall(r'interrupts\.reached\("([a-z-]+)"\)', path.read_text(encoding="utf-8")))
    assert used == set(interrupts.POINTS) - {"import:MODULE"}


def test_an_operation_may_say_what_its_interrupt_leaves(capsys: pytest.CaptureFixture[str]) -> None:
    """``interrupts.explain`` (auto-transform: "start it again") wins over the last run's --resume advice."""
    exc = interrupts.Signalled(signal.SIGTERM)
    setattr(exc, manifest.PROGRESS_ATTRIBUTE, manifest.RunProgress(1, 1, resumable=False))
    interrupts.explain(exc, "rank 0 not ready yet; start it again")
    assert cli.interrupted(exc) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "reshard: interrupted (SIGTERM): rank 0 not ready yet; start it again\n"
    plain = interrupts.Signalled(signal.SIGTERM)
    setattr(plain, manifest.PROGRESS_ATTRIBUTE, manifest.RunProgress(1, 1, resumable=False))
    cli.interrupted(plain)
    assert "--no-manifest" in capsys.readouterr().err  # a transform's own line is unchanged
