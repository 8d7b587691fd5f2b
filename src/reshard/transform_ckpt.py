"""MindFormers' TransformCkpt tool (``tools/ckpt_transform/transform_checkpoint.py``) without MindSpore.

A training script that calls ``python transform_checkpoint.py --src_checkpoint ... --dst_checkpoint_dir
...`` can call ``reshard transform`` with the same flags and get the same tree, byte for byte
(docs/formats.md §11): for each source model ``DST/<stem>/rank_<r>/<prefix><r>.ckpt`` and the marker
files ``transform_succeed_rank_<r>.txt`` (empty) or ``transform_failed_rank_<r>.txt`` (the error)
that MindFormers' ranks poll. The conversions themselves are the MindSpore drop-in's
``transform_checkpoints`` / ``transform_checkpoint_by_rank`` (byte-identical to MindSpore), so
this module only reproduces the tool's choices around them: which source models a path names,
which invocation converts which destination ranks (``--rank_id``, ``--world_size``,
``--transform_process_num``, ``--transform_by_rank``), which file of a rank folder a by-rank
conversion reads, and the marker protocol.

Where it deliberately differs (docs/formats.md §11.3): strategy folders are merged in a temporary
file, never into the user's folder (MindFormers writes ``merged_ckpt_strategy.ckpt`` there); the
output folder of a model is cleared only of what this tool writes (MindFormers deletes the whole
folder), and a folder holding anything else is refused; every check MindFormers makes before its
conversion runs before anything is written; no log folder is written; the main invocation is the
one whose rank is 0 (MindFormers asks the ``RANK_ID`` variable even when ``--rank_id`` says
otherwise); ModelArts/OBS paths are not supported.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from reshard import mindspore as drop_in
from reshard.errors import ReshardError, UsageError
from reshard.formats import rank_dirs
from reshard.formats.strategy import JSON, find_strategy_files, format_of, merge_strategy_files
from reshard.text import one_line

SUCCEED = "transform_succeed_rank_{rank}.txt"
FAILED = "transform_failed_rank_{rank}.txt"
MERGED_NAME = "merged_ckpt_strategy.ckpt"  # what MindFormers merges a strategy folder into (left out here)
DEFAULT_DST = "transformed_checkpoint"  # under the working directory, when --dst_checkpoint_dir is empty
_MARKER = re.compile(r"transform_(succeed|failed)_rank_\d+\.txt")
_RANK_FOLDER = re.compile(r"rank_\d+")
_OUTPUT_FILE = re.compile(r".+\.ckpt")
POLL_SECONDS = 0.5  # MindFormers polls every 5 s


@dataclass(frozen=True)
class ToolArgs:
    """The tool's flags, with its defaults (``rank_id`` 0 / ``world_size`` 0 defer to the environment)."""

    src_checkpoint: str = ""
    dst_checkpoint_dir: str = ""
    src_strategy: str | None = None
    dst_strategy: str | None = None
    prefix: str = "checkpoint_"
    rank_id: int = 0
    world_size: int = 1
    transform_process_num: int = 1
    transform_by_rank: bool = False


@dataclass
class ToolResult:
    """What one invocation did: the model folders it worked in and the files it wrote."""

    dst_dir: str
    model_dirs: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Job:
    """Who this invocation is and which destination ranks it converts."""

    rank: int
    world_size: int
    process_num: int
    converts: bool  # this rank is one of the tool's converting ranks
    by_rank: bool


def _environment_int(name: str, default: int) -> int:
    text = os.environ.get(name, str(default))
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"environment variable {name}={text!r} is not a whole number") from None


def plan_job(args: ToolArgs, notes: list[str]) -> _Job:
    """The tool's rank arithmetic: converting ranks ``range(0, W, W // P)``; by-rank for ``P > 1``."""
    rank = args.rank_id or _environment_int("RANK_ID", 0)  # the tool's `rank_id if rank_id else get_real_rank()`
    world = args.world_size or _environment_int("RANK_SIZE", 1)
    if rank < 0:
        raise UsageError(f"--rank_id {rank}: ranks count from 0")
    if world < 1:
        raise UsageError(f"--world_size {world}: must be at least 1")
    process_num = args.transform_process_num
    if process_num < 1:
        raise UsageError(f"--transform_process_num {process_num}: must be at least 1")
    if process_num > world:
        notes.append(f"--transform_process_num {process_num} is more than --world_size {world}: {world} is used")
        process_num = world
    if world % process_num:
        raise UsageError(f"--transform_process_num {process_num} does not divide --world_size {world}")
    by_rank = True if process_num > 1 else (False if world == 1 else args.transform_by_rank)
    converts = rank in range(0, world, world // process_num)
    return _Job(rank, world, process_num, converts, by_rank)


# ------------------------------------------------------------------------------- sources


def source_models(src: str) -> dict[str, list[tuple[str, str]]]:
    """``{stem: [(name in the model folder, real path)]}``: the models a ``--src_checkpoint`` names.

    A folder holding ``rank_0`` is one distributed model named after the folder; a folder of
    ``.ckpt`` files is one full model per file and a ``.ckpt`` file one full model, each named by
    the file name up to its first dot (``rank_0/<file>`` inside the model, as the tool links it).
    """
    if not os.path.exists(src):
        raise UsageError("--src_checkpoint is not found", src)
    real = os.path.realpath(src)
    if os.path.isdir(real):
        if os.path.isdir(os.path.join(real, "rank_0")):
            return {os.path.basename(real): [("", real)]}
        files = sorted(p for p in glob.glob(os.path.join(glob.escape(real), "*.ckpt")))
        if not files:
            raise UsageError("no rank_0 folder and no .ckpt files in --src_checkpoint", src)
        models: dict[str, list[tuple[str, str]]] = {}
        for path in files:
            name = os.path.basename(path)
            models.setdefault(name.split(".")[0], []).append((os.path.join("rank_0", name), path))
        return models
    if not real.endswith(".ckpt"):
        raise UsageError("--src_checkpoint must be a folder or a .ckpt file", src)
    name = os.path.basename(real)
    return {name.split(".")[0]: [(os.path.join("rank_0", name), real)]}


def _link_models(models: dict[str, list[tuple[str, str]]], into: str) -> dict[str, str]:
    """Each model as a folder of ``rank_<r>`` folders under ``into`` (symbolic links, as the tool makes)."""
    folders = {}
    for stem, entries in models.items():
        folder = os.path.join(into, stem)
        for inner, real in entries:
            link = os.path.join(folder, inner) if inner else folder
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(real, link)
        folders[stem] = folder
    return folders


def check_model(folder: str, src_strategy: str | None) -> None:
    """The tool's checks of one model: ``rank_0 .. rank_<n-1>`` without gaps, and a source strategy
    for a sliced model."""
    ranks = sorted(rank_dirs.rank_dirs(folder))
    for expected, rank in enumerate(ranks):
        if rank != expected:
            raise UsageError(f"the rank_{expected} folder is missing", os.path.realpath(folder))
    if len(ranks) > 1 and src_strategy is None:
        raise UsageError(
            f"{len(ranks)} rank folders but no --src_strategy: a sliced checkpoint needs its strategy",
            os.path.realpath(folder),
        )


# ------------------------------------------------------------------------------- strategies


def strategy_file(value: str | None, what: str, scratch: str) -> str | None:
    """A strategy file path for the drop-in: a folder of per-stage files is merged into ``scratch``.

    The merge takes the folder's files in listing order, without an earlier ``merged_ckpt_strategy.ckpt``
    (the tool deletes that one and merges the rest into the folder; reshard never writes there).
    """
    if not value or value == "None":
        return None
    if not os.path.exists(value):
        raise UsageError(f"{what} is not found", value)
    if os.path.isfile(value):
        return value
    files = find_strategy_files(value, exclude=os.path.join(value, MERGED_NAME))
    listing = {name: i for i, name in enumerate(os.listdir(value))}
    files.sort(key=lambda f: listing.get(os.path.basename(f), len(listing)))
    fmt, data = merge_strategy_files(files)
    merged = os.path.join(scratch, f"{what.strip('-')}{'.json' if fmt == JSON else '.ckpt'}")
    with open(merged, "wb") as fh:
        fh.write(data)
    assert (format_of(merged) == JSON) == (fmt == JSON)
    return merged


# ------------------------------------------------------------------------------- output folder


def clear_earlier_output(model_dir: str) -> None:
    """Remove what an earlier run of the tool left in ``model_dir``: marker files and ``rank_<r>``
    folders holding only ``.ckpt`` files. Anything else is refused before anything is removed."""
    if not os.path.isdir(model_dir):
        if os.path.lexists(model_dir):
            raise UsageError("the output folder of this model exists and is not a folder", model_dir)
        return
    doomed: list[tuple[str, bool]] = []
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if _MARKER.fullmatch(name) and os.path.isfile(path) and not os.path.islink(path):
            doomed.append((path, False))
        elif _RANK_FOLDER.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
            for inner in sorted(os.listdir(path)):
                inner_path = os.path.join(path, inner)
                if not (_OUTPUT_FILE.fullmatch(inner) and os.path.isfile(inner_path)) or os.path.islink(inner_path):
                    raise UsageError("holds a file the transform tool did not write; move it away", inner_path)
            doomed.append((path, True))
        else:
            raise UsageError(
                "the output folder of this model holds something the transform tool did not write; move it away",
                path,
            )
    for path, is_folder in doomed:
        shutil.rmtree(path) if is_folder else os.remove(path)


def check_apart(model_dir: str, inputs: Sequence[str]) -> None:
    """Refuse an output folder that is, holds or lies inside an input: the tool would delete or
    overwrite the user's checkpoint (``--dst_checkpoint_dir`` naming the source's parent, say)."""
    out = os.path.realpath(model_dir)
    for path in inputs:
        if os.path.commonpath([out, path]) in (out, path):
            raise UsageError(
                f"the output folder of this model and the input {path} overlap: choose another --dst_checkpoint_dir",
                model_dir,
            )


def write_marker(model_dir: str, template: str, rank: int, text: str = "") -> str:
    path = os.path.join(model_dir, template.format(rank=rank))
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def wait_for_markers(model_dir: str, count: int, say: Callable[[str], None], poll: float = POLL_SECONDS) -> None:
    """Block until ``count`` success markers are in ``model_dir``; a failure marker ends the wait."""
    told = False
    while True:
        failed = sorted(glob.glob(os.path.join(glob.escape(model_dir), FAILED.format(rank="*"))))
        if failed:
            raise UsageError(f"the transform failed on another rank: see {', '.join(failed)}", model_dir)
        done = glob.glob(os.path.join(glob.escape(model_dir), SUCCEED.format(rank="*")))
        if len(done) >= count:
            return
        if not told:
            say(
                f"waiting for {count - len(done)} more transform_succeed_rank_<r>.txt in {model_dir} "
                f"(written by the other ranks' invocations; {len(done)} of {count} there)"
            )
            told = True
        time.sleep(poll)


# ------------------------------------------------------------------------------- conversion


def newest_ckpt(rank_folder: str, rank: int) -> str:
    """The tool's by-rank choice: the ``.ckpt`` of the folder with the latest modification time."""
    files = glob.glob(os.path.join(glob.escape(rank_folder), "*.ckpt"))
    if not files:
        raise UsageError(f"the checkpoint of rank_{rank} is not found", os.path.realpath(rank_folder))
    return max(files, key=lambda p: (os.path.getmtime(p), p))


def convert_by_rank(
    model: str, model_dir: str, ranks: range, prefix: str, src: str | None, dst: str | None
) -> list[str]:
    written = []
    for rank in ranks:
        needed = drop_in.rank_list_for_transform(rank, src, dst)
        files = {r: newest_ckpt(os.path.join(model, f"rank_{r}"), r) for r in needed}
        out = rank_dirs.rank_output(model_dir, rank, prefix, "ckpt")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        drop_in.transform_checkpoint_by_rank(rank, files, out, src, dst)
        written.append(out)
    return written


def convert_all(model: str, model_dir: str, prefix: str, src: str | None, dst: str | None) -> list[str]:
    drop_in.transform_checkpoints(model, model_dir, prefix, src, dst)
    return _outputs(model_dir)  # the converting rank of a one-pass run is rank 0, which cleared the folder


def _outputs(model_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(model_dir), "rank_*", "*.ckpt")))


@contextmanager
def _scratch() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="reshard-transform-ckpt-") as folder:
        yield folder


def run(args: ToolArgs, say: Callable[[str], None] = lambda _: None) -> ToolResult:
    """Do what one invocation of MindFormers' ``transform_checkpoint.py`` with these flags does.

    Args:
        args: The tool's flags.
        say: Where notes go (one line each), e.g. the CLI's stderr.

    Returns:
        A ``ToolResult``: the destination, the model folders and the files this invocation wrote.

    Raises:
        UsageError: A missing source or strategy, a source that is neither a ``.ckpt`` file nor a folder
            holding ``rank_0`` or ``.ckpt`` files, rank folders with a gap, a sliced source without a
            source strategy, both strategies None, bad rank arithmetic, an unsafe prefix, an output
            folder holding files the tool did not write; or another rank's failure marker. Nothing is
            written for any of these but the last.
        ReshardError: The conversion failed (after ``transform_failed_rank_<r>.txt`` was written).

    Example:
        from reshard import transform_ckpt
        transform_ckpt.run(transform_ckpt.ToolArgs("demo/ckpt_8ranks", "out", "demo/strategy_8", None))
    """
    notes: list[str] = []
    job = plan_job(args, notes)
    rank_dirs.check_prefix(args.prefix)
    models = source_models(args.src_checkpoint)
    dst_dir = os.path.realpath(args.dst_checkpoint_dir) if args.dst_checkpoint_dir else ""
    if not dst_dir:
        dst_dir = os.path.join(os.getcwd(), DEFAULT_DST)
        notes.append(f"--dst_checkpoint_dir is empty: writing into {dst_dir}")
    result = ToolResult(dst_dir, notes=notes)
    with _scratch() as scratch:
        src = strategy_file(args.src_strategy, "--src_strategy", scratch)
        dst = strategy_file(args.dst_strategy, "--dst_strategy", scratch)
        folders = _link_models(models, os.path.join(scratch, "models"))
        for folder in folders.values():
            check_model(folder, src)
        if src is None and dst is None:
            raise UsageError("--src_strategy and --dst_strategy cannot both be None")
        for note in notes:
            say(note)
        inputs = [real for entries in models.values() for _, real in entries]
        inputs += [os.path.realpath(p) for p in (args.src_strategy, args.dst_strategy) if p and os.path.exists(p)]
        for stem in folders:
            check_apart(os.path.join(dst_dir, stem), inputs)
        for stem, folder in sorted(folders.items()):
            model_dir = os.path.join(dst_dir, stem)
            result.model_dirs.append(model_dir)
            result.written += _one_model(job, folder, model_dir, args.prefix, src, dst, say)
    return result


def _one_model(
    job: _Job, folder: str, model_dir: str, prefix: str, src: str | None, dst: str | None, say: Callable[[str], None]
) -> list[str]:
    if job.rank == 0:
        clear_earlier_output(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    written: list[str] = []
    if job.converts:
        for template in (SUCCEED, FAILED):  # this rank's markers of an earlier run
            stale = os.path.join(model_dir, template.format(rank=job.rank))
            if os.path.isfile(stale):
                os.remove(stale)
        try:
            if job.by_rank:
                share = job.world_size // job.process_num
                written = convert_by_rank(folder, model_dir, range(job.rank, job.rank + share), prefix, src, dst)
            else:
                written = convert_all(folder, model_dir, prefix, src, dst)
        except ReshardError as exc:
            write_marker(model_dir, FAILED, job.rank, one_line(str(exc)))
            raise
        written.append(write_marker(model_dir, SUCCEED, job.rank))
    wait_for_markers(model_dir, job.process_num, say)
    return written


def parse_bool(text: str | None) -> bool:
    """The tool's ``type=bool`` flag: any non-empty value is True (``--transform_by_rank False`` too)."""
    return bool(text) if text is not None else True


def bool_note(text: str | None) -> str | None:
    if text is not None and text.strip().lower() in ("false", "0", "no", "off"):
        return (
            f"--transform_by_rank {text} means True, as in MindFormers' tool (argparse type=bool: any "
            "non-empty value); leave the flag out to convert in one pass"
        )
    return None


def written_bytes(paths: Sequence[str]) -> int:
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


__all__ = [
    "DEFAULT_DST",
    "FAILED",
    "MERGED_NAME",
    "SUCCEED",
    "ToolArgs",
    "ToolResult",
    "bool_note",
    "check_apart",
    "check_model",
    "clear_earlier_output",
    "convert_all",
    "convert_by_rank",
    "newest_ckpt",
    "parse_bool",
    "plan_job",
    "run",
    "source_models",
    "strategy_file",
    "wait_for_markers",
    "write_marker",
    "written_bytes",
]
