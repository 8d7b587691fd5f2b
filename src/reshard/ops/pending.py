"""A check of a run's inputs that runs beside the copy, and is waited for before any output is renamed into place.

Why: the replica check (``reshard.sources.replicas``) reads three small samples of every replicated
tensor, scattered over the rank files, and compares them; none of its reads is one the copy needs.
Run before the copy, it held the run up: the start-up read-ahead waited for its reads
(``readahead.paused``) and the copy started after it. A cold merge of the bench's 8 rank files took
0.623 s with the check and 0.603 s without it (medians of 20). Now it runs on a thread of its own,
started once the copy has copied its first tensor (``gated`` wraps ``RunOptions.progress``): started
with the copy, its Python work (6 ms of it matching slices to ranks) took the GIL from the planning
left before the copy's first read, which then came 13-16 ms after the check began instead of 5 ms.
Its reads share the disk with the copy's, and the outputs wait for its verdict: ``gated`` hands the
executor a ``RunOptions.before_commit`` that joins it, so a run from copies that differ still leaves
no output (the temporary files are removed as for any error), and the error is the same line as before.

Only beside a copy into one file (``beside_the_copy``: a merge, a unify's part). Beside the four
copies of a transform 8 -> 4 ranks, each reading ahead in large requests, the check's small reads
queued behind theirs and it took 190-265 ms instead of 18: the cold transform went 0.511 -> 0.528 s
(medians of 10), where the merge went 0.571 -> 0.563 s (of 20) and the unify 0.524 -> 0.513 s (of 10).
Where the verdict is needed without such a copy (a dry run, outputs of several files, a Ray run,
whose nodes rename their own outputs), ``wait`` runs it on the spot, before the copy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

from reshard.execute.options import RayOptions, RunOptions
from reshard.plan import Plan

ONE_FILE_SHARE = 0.9  # a plan whose largest output holds this share of its bytes is copied as one file


class PendingCheck:
    """``check()`` on a daemon thread, started by ``start`` (or the first ``wait``); ``wait`` returns once
    it is done, or raises what it raised."""

    def __init__(self, check: Callable[[], object], name: str = "reshard-check") -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(check,), name=name, daemon=True)
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def _run(self, check: Callable[[], object]) -> None:
        try:
            check()
        except BaseException as exc:  # handed to whoever waits
            self._error = exc

    def wait(self) -> None:
        error = self.failed()
        if error is not None:
            raise error

    def failed(self) -> BaseException | None:
        """What the check raised, once it is done (None: it passed)."""
        self.start()
        self._thread.join()
        return self._error

    def gated(self, run: RunOptions | None) -> RunOptions:
        """``run`` with the check started once its first tensor is copied (``progress``) and its outputs
        renamed into place only once the check passed (a Ray run: checked now)."""
        run = run or RunOptions()
        if isinstance(run, RayOptions):
            self.wait()
            return run
        copied, committing = run.progress, run.before_commit

        def progress(nbytes: int) -> None:
            self.start()
            if copied is not None:
                copied(nbytes)

        def before_commit() -> None:
            self.wait()
            if committing is not None:
                committing()

        return replace(run, progress=progress, before_commit=before_commit)


def beside_the_copy(plan: Plan) -> bool:
    """Whether a check runs best beside ``plan``'s copy: one output file holds (nearly) all its bytes."""
    sizes = [f.nbytes for f in plan.files]
    return bool(sizes) and max(sizes) >= ONE_FILE_SHARE * sum(sizes)


@contextlib.contextmanager
def its_error_first(pending: PendingCheck | None) -> Iterator[None]:
    """Code run while ``pending`` runs, which would have run after it: an error the check raises wins
    over the block's own (the one a user saw when the check ran first)."""
    try:
        yield
    except Exception:
        failed = pending.failed() if pending is not None else None
        if failed is not None:
            raise failed from None
        raise


__all__ = ["ONE_FILE_SHARE", "PendingCheck", "beside_the_copy", "its_error_first"]
