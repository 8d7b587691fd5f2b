"""Every check of the paths a run writes, made before its first byte.

A run that fails after writing most of its output leaves the user worse off than one refused at
once: the output is rolled back, the time is lost, and a report path that was wrong all along
could have been named in a second. So every operation's run path calls this module with all the
paths it will write (the destination folder, and side files such as a name report, a picture, a
merged strategy or a ``config.json``) and the paths it reads, and it refuses in one line:

* a destination equal to a source, inside a source folder, or holding a source (a run writing
  there could replace what it reads, and ``--overwrite`` would clean up beside the user's files);
* a destination that is a file, a read-only folder, a folder another run holds the lock of, or a
  non-empty folder without ``--overwrite`` / ``--resume``;
* a side file whose folder is missing or read-only, that is a folder, lies in a source, or is a
  file already there without ``--overwrite`` (a single file records nothing of who wrote it, so
  reshard cannot tell its own earlier output from a file of the user's: it asks);
* a plan whose bytes exceed the free space of a destination filesystem (``os.statvfs``), naming
  both numbers. The check counts the whole plan (an ``--overwrite`` writes each new file beside the
  old one before renaming it over), less the files a ``--resume`` keeps.

Space can still run out during a run (another writer); ``manifest.run_recorded`` then keeps the
finished, journaled files for ``--resume`` instead of rolling them back.

Test-only hooks (environment variables; no user sets them): ``RESHARD_TEST_FREE_BYTES=N`` makes
every free-space reading return N bytes, so the refusal is tested without a small filesystem.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from reshard import arguments
from reshard import lock as _lock
from reshard import manifest as _manifest
from reshard.arguments import StrPath
from reshard.errors import UsageError
from reshard.plan import FilePlan, Plan
from reshard.text import OVERWRITE, RESUME, format_size

FREE_BYTES_ENV = "RESHARD_TEST_FREE_BYTES"  # test-only: the free space every filesystem reports
# A plan counts tensor bytes; a file adds its header (a .ckpt's per-tensor protobuf framing, a
# safetensors JSON entry): at most the name, this much, and a number's digits per dimension; plus
# a page per file (crc trailer, safetensors metadata, alignment).
HEADER_BYTES_PER_TENSOR = 96
HEADER_BYTES_PER_DIM = 24
HEADER_BYTES_PER_FILE = 4096


def _within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (both absolute, symlinks resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def overlap(path: str, sources: Iterable[str]) -> str | None:
    """The first source that ``path`` equals, lies inside, or holds (None: it touches none).

    Args:
        path: A path a run writes (a folder or a file; it need not exist).
        sources: The paths the run reads (files or folders).

    Returns:
        The source as given, or None.

    Raises:
        Nothing.

    Example:
        from reshard import destination
        assert destination.overlap("demo/ckpt_8ranks/out", ["demo/ckpt_8ranks"]) == "demo/ckpt_8ranks"
    """
    target = os.path.realpath(path)
    for src in sources:
        src_abs = os.path.realpath(src)
        if _within(target, src_abs) or _within(src_abs, target):
            return src
    return None


def check_destination(dst: StrPath, sources: Sequence[StrPath], overwrite: bool, resume: bool = False) -> None:
    """Refuse a destination folder a run must not write into.

    Refused: a destination equal to, inside, or holding a source; a file; a read-only folder; a
    folder another run holds the lock of; a non-empty folder unless ``overwrite`` or ``resume``.

    Args:
        dst: The destination folder (it need not exist yet).
        sources: The source paths (files or folders) the run reads.
        overwrite: Accept a non-empty destination whose files the run replaces.
        resume: Accept a non-empty destination holding an interrupted run to continue.

    Returns:
        None; the destination is fine when nothing is raised.

    Raises:
        UsageError: For each refusal above, naming ``dst``.

    Example:
        from reshard import destination
        destination.check_destination("out_4ranks", ["demo/ckpt_8ranks"], overwrite=False)
    """
    dst = arguments.path(dst, "dst")
    src = overlap(dst, [arguments.path(s, "a source") for s in sources])
    if src is not None:
        raise UsageError(f"destination {_relation(dst, src)} the source {src}: choose a folder outside it", dst)
    if os.path.isfile(dst):
        raise UsageError("destination exists and is a file", dst)
    if os.path.isdir(dst) and not os.access(dst, os.W_OK):
        raise UsageError("destination folder is read-only", dst)
    _check_parent(dst, "destination")
    holder = _lock.is_held(dst) if os.path.isdir(dst) else None
    if holder is not None:
        raise UsageError(
            f"{_lock.describe(holder)} is writing into this destination; wait for it to finish or stop it", dst
        )
    if os.path.isdir(dst) and _entries(dst) and not (overwrite or resume):
        if _manifest.has_unfinished_run(dst):
            raise UsageError(f"destination holds an unfinished run (use {RESUME} to continue it)", dst)
        raise UsageError(f"destination is not empty (use {OVERWRITE} to replace the files this run writes)", dst)


def _relation(path: str, src: str) -> str:
    target, src_abs = os.path.realpath(path), os.path.realpath(src)
    if target == src_abs:
        return "is"
    return "lies inside" if _within(target, src_abs) else "holds"


def _entries(folder: str) -> list[str]:
    """What a folder holds, without a lock file a killed run left (it is no output)."""
    return [name for name in os.listdir(folder) if name != _lock.LOCK_NAME]


def _check_parent(path: str, what: str) -> None:
    """The nearest existing folder above ``path`` must be a folder we may create entries in."""
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"cannot create the {what}: {parent} is not a folder", path)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot create the {what}: {parent} is read-only", path)


def check_output_file(path: str, sources: Sequence[str], overwrite: bool, what: str, make_folder: bool = False) -> None:
    """Refuse a side file (name report, picture, merged strategy, config.json) before any byte.

    Args:
        path: The file the run will write.
        sources: The paths the run reads.
        overwrite: Accept replacing a file already at ``path``.
        what: What the file is, for the message ("name report", "merged strategy", ...).
        make_folder: The writer creates a missing folder (``merge-strategies``, as MindSpore does);
            then the nearest existing folder above must be writable (False: the folder must exist).

    Returns:
        None; the path is fine when nothing is raised.

    Raises:
        UsageError: A path that is a folder, lies in or holds a source, sits in a missing or
            read-only folder, or names an existing file without ``overwrite``.

    Example:
        from reshard import destination
        destination.check_output_file("names.json", ["demo/ckpt_8ranks"], overwrite=False, what="name report")
    """
    if os.path.isdir(path):
        raise UsageError(f"the {what} path is a folder: give a file name", path)
    check_not_source(path, sources, what)
    folder = os.path.dirname(os.path.abspath(path))
    if make_folder and not os.path.lexists(folder):
        _check_parent(folder, f"folder of the {what}")
        return
    if not os.path.isdir(folder):
        raise UsageError(f"no such folder for the {what}", path)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write the {what}: its folder is read-only", path)
    if os.path.lexists(path) and not overwrite:
        raise UsageError(f"the {what} file exists (use {OVERWRITE} to replace it)", path)


def check_not_source(path: str, sources: Iterable[str], what: str) -> None:
    """Refuse an output file that is a source or lies inside a source folder.

    Args:
        path: The file a run writes.
        sources: The paths the run reads.
        what: What the file is, for the message.

    Returns:
        None; the path touches no source when nothing is raised.

    Raises:
        UsageError: Naming the source ``path`` would replace or lie in.

    Example:
        from reshard import destination
        destination.check_not_source("out/checkpoint_0.ckpt", ["demo/ckpt_8ranks"], "output")
    """
    src = overlap(path, sources)
    if src is not None:
        where = "would replace" if _relation(path, src) == "is" else "would be written inside"
        raise UsageError(f"the {what} {where} the source {src}: choose a path outside it", path)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path`` (it exists).

    Args:
        path: An existing path.

    Returns:
        ``f_bavail * f_frsize`` of ``os.statvfs`` (the test hook ``RESHARD_TEST_FREE_BYTES`` overrides it).

    Raises:
        OSError: ``statvfs`` fails.

    Example:
        from reshard import destination
        print(destination.free_bytes("."))
    """
    forced = os.environ.get(FREE_BYTES_ENV)
    if forced is not None:
        return int(forced)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _existing_ancestor(path: str) -> str:
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return folder


def check_free_space(plan: Plan, root: str, resume: bool = False) -> None:
    """Refuse a run whose outputs do not fit the free space of each destination filesystem.

    Args:
        plan: The plan about to run.
        root: The folder holding the run's journal (what ``resume`` keeps is read from it).
        resume: Count only the files an interrupted run has not journaled yet.

    Returns:
        None; the outputs fit when nothing is raised.

    Raises:
        UsageError: A filesystem has less free space than the bytes this run writes there (both named).

    Example:
        from reshard import api, destination
        report = api.transform("demo/ckpt_8ranks", "out", "demo/strategy_8", "demo/strategy_4",
                               destination=api.Destination(dry_run=True))
        destination.check_free_space(report.plan, "out")
    """
    kept = _journaled(root) if resume else set()
    bytes_on: dict[int, int] = {}  # st_dev -> bytes this run writes there
    folder_on: dict[int, str] = {}  # st_dev -> an existing folder on it
    for f in plan.files:
        if os.path.abspath(f.path) in kept:
            continue
        anchor = _existing_ancestor(os.path.dirname(f.path))
        dev = os.stat(anchor).st_dev
        bytes_on[dev] = bytes_on.get(dev, 0) + needed_bytes(f)
        folder_on.setdefault(dev, anchor)
    for dev, size in bytes_on.items():
        folder = folder_on[dev]
        try:
            free = free_bytes(folder)
        except OSError:
            continue  # a filesystem that cannot say: the write itself will tell
        if size > free:
            raise UsageError(
                f"not enough free space: this run needs {format_size(size)} ({size} bytes) and the "
                f"filesystem of {folder} has {format_size(free)} ({free} bytes) free",
                root,
            )


def needed_bytes(file: FilePlan) -> int:
    """The space an output takes at most: its tensors' bytes and a bound on its header."""
    header = sum(
        HEADER_BYTES_PER_TENSOR + len(t.name.encode()) + HEADER_BYTES_PER_DIM * len(t.shape) for t in file.tensors
    )
    return file.nbytes + HEADER_BYTES_PER_FILE + header


def _journaled(root: str) -> set[str]:
    """Absolute paths of outputs an interrupted run journaled and left whole (same size)."""
    kept: set[str] = set()
    for rel, record in _manifest.read_journal(root).items():
        path = os.path.join(os.path.abspath(root), rel)
        try:
            if os.path.getsize(path) == record.size:
                kept.add(path)
        except OSError:
            continue
    return kept


__all__ = [
    "FREE_BYTES_ENV",
    "check_destination",
    "check_free_space",
    "check_not_source",
    "check_output_file",
    "free_bytes",
    "needed_bytes",
    "overlap",
]
