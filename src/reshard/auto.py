"""``auto_transform``: the conversion at job start, done once per destination file for all callers.

MindFormers' ``auto_trans_ckpt: True`` makes every start of a job delete its earlier output, merge
the job's strategy files, convert the whole checkpoint on rank 0 and let the other ranks wait
(docs/formats.md §6.2). Here every rank (on every node) calls ``auto_transform`` at the same
moment instead, and gets the path of the one file it must load from a cache that all callers
share (docs/formats.md §14 says it all in one place):

* **Waiting.** The destination strategy may be the job's ``strategy`` folder its ranks are still
  writing: the call waits (sleeping with backoff) until its files describe every rank — one file of
  each pipeline stage that parses and has kept its size for a moment (a folder of per-stage files
  is complete at once) — then merges them in memory (``reshard.strategy_wait``).
* **Cache key.** ``<cache_dir>/<key>/`` where the key hashes the source files' identity (path,
  size, ``mtime_ns`` and a hash of their first and last bytes, never the whole data), the content
  of both merged strategies, the output format and reshard's version. Same inputs, same entry: a
  second job start converts nothing.
* **Converted once.** Each ``rank_<r>`` of an entry has a lock (``reshard.lock``: ``flock`` and a
  holder record; a holder that died is taken over). Its holder converts into a work folder, renames
  the result into place and writes the rank's done marker last (atomic rename); every other caller
  sleeps with backoff until the marker is there or the lock is free.
* **Per node.** A caller converts its own rank, or the ``local_ranks`` of its node, reading only the
  source ranks those need (``api.transform(ranks=...)``).
* **Eviction.** Only whole entries of the cache are ever deleted: unused for longer than the age
  limit, or the oldest unused ones while the cache exceeds its size limit; never an entry a caller
  is using (it holds the entry's shared lock) or converting into.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from reshard import __version__, api, arguments, destination, interrupts
from reshard import lock as _lock
from reshard.arguments import StrPath
from reshard.errors import LayoutError, ReshardError, UnsupportedError, UsageError
from reshard.formats import registry
from reshard.formats.strategy import (
    StrategyFile,
    encode_strategy,
    load_strategy,
)
from reshard.naming import NameOptions
from reshard.sources import resolve
from reshard.sources.conventions import find_source_strategy, needs_strategy
from reshard.strategy_wait import SETTLE_VARIABLE, StrategyWait, backoff, ranges, ranks_of, wait_for_strategy
from reshard.text import parse_size

CACHE_VARIABLE = "RESHARD_CACHE"  # the default cache folder
CACHE_MAX_VARIABLE = "RESHARD_CACHE_MAX"  # size limit of the cache (e.g. 500GB); unset: none
CACHE_MAX_AGE_VARIABLE = "RESHARD_CACHE_MAX_AGE_DAYS"  # entries unused for longer are removed (0: never)
TEST_PAUSE_VARIABLE = "RESHARD_AUTO_TEST_PAUSE"  # TEST ONLY: seconds a converter sleeps before committing
DEFAULT_TIMEOUT = 3600.0  # seconds to wait for the destination strategy files
DEFAULT_MAX_AGE_DAYS = 30.0
PREFIX = "checkpoint_"
ENTRY_NAME = re.compile(r"[0-9a-f]{32}")
IN_USE = ".in-use"
LAST_USED = ".last-used"
ENTRY_INFO = "entry.json"
CONVERSIONS_LOG = "conversions.log"
_DONE, _LOCKS, _WORK = ".done", ".locks", ".work"
_HEAD_BYTES, _TAIL_BYTES = 64 * 1024, 4 * 1024


# --------------------------------------------------------------------------------------------
# The cache key


def default_cache_dir() -> str:
    """``$RESHARD_CACHE``, else ``$XDG_CACHE_HOME/reshard/transformed`` (``~/.cache/reshard/transformed``)."""
    given = os.environ.get(CACHE_VARIABLE)
    if given:
        return os.path.abspath(os.path.expanduser(given))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "reshard", "transformed"))


def source_files(checkpoint: str) -> list[str]:
    """Every file the source may be read from: the file, or all visible files under its folder."""
    root = os.path.abspath(checkpoint)
    if os.path.isfile(root):
        name = os.path.basename(root)
        if not name.endswith(".index.json"):  # a Hugging Face index stands for its folder
            return [root]
        root = os.path.dirname(root)
    found: list[str] = []
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(os.path.join(folder, f) for f in sorted(files) if not f.startswith("."))
    return found


def file_identity(path: str, root: str) -> str:
    """``name size mtime_ns hash``: ``name`` relative to the checkpoint (a shared disk mounted at
    another path on another node gives the same key); the hash covers the first 64 KiB (headers)
    and the last 4 KiB."""
    st = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        digest.update(fh.read(_HEAD_BYTES))
        if st.st_size > _HEAD_BYTES:
            fh.seek(max(_HEAD_BYTES, st.st_size - _TAIL_BYTES))
            digest.update(fh.read(_TAIL_BYTES))
    return f"{os.path.relpath(path, root)} {st.st_size} {st.st_mtime_ns} {digest.hexdigest()}"


def cache_key(
    checkpoint: str,
    src: StrategyFile | None,
    dst: StrategyFile,
    output_format: str | None,
    names: NameOptions | None = None,
) -> tuple[str, dict[str, object]]:
    """The entry name (32 hex digits) and the facts it was computed from (kept in ``entry.json``).

    Filters and maps (``names``) are part of the key when given (without them the key is unchanged).
    """
    files = source_files(checkpoint)
    root = os.path.dirname(os.path.abspath(checkpoint))
    digest = hashlib.sha256(f"reshard-auto 1 {__version__} {output_format}\n".encode())
    if names is not None and names.active:
        digest.update(f"names {names.fingerprint()}\n".encode())
    for path in files:
        digest.update(file_identity(path, root).encode("utf-8", "surrogateescape") + b"\n")
    for sf in (src, dst):
        data = encode_strategy(sf) if sf is not None else b"full"
        digest.update(hashlib.sha256(data).digest())
    facts: dict[str, object] = {
        "checkpoint": os.path.abspath(checkpoint),
        "source_files": len(files),
        "output_format": output_format,
        "reshard": __version__,
        "src_strategy": src.path if src is not None else None,
        "dst_strategy": dst.path,
    }
    if names is not None and names.active:
        facts["names"] = json.loads(names.fingerprint())
    return digest.hexdigest()[:32], facts


# --------------------------------------------------------------------------------------------
# Entries, their locks and markers


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{_lock.host_name()}-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def entry_in_use(entry: str) -> Iterator[None]:
    """Hold the entry's shared lock while using it: eviction (an exclusive lock) passes it over."""
    fd = _open_in_use(entry)
    try:
        yield
    finally:
        os.close(fd)


def _open_in_use(entry: str) -> int:
    path = os.path.join(entry, IN_USE)
    for _ in range(10):
        try:  # an error here is the cache's place (/proc, a read-only disk), never an eviction
            os.makedirs(entry, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot write into the cache: {exc.strerror or exc}", entry) from None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # an evictor renamed the entry away between the two calls
            continue
        except OSError as exc:
            raise UsageError(f"cannot write into the cache: {exc.strerror or exc}", entry) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # an evictor holds the exclusive lock only for a rename
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # evicted under us: make the entry again
    raise UsageError("the cache entry keeps being evicted while this job starts", entry)


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False


def _marker(entry: str, rank: int) -> str:
    return os.path.join(entry, _DONE, f"rank_{rank}.json")


def done_file(entry: str, rank: int) -> str | None:
    """The file a finished rank of ``entry`` holds, or None while its marker is not written."""
    try:
        with open(_marker(entry, rank), encoding="utf-8") as fh:
            name = json.load(fh)["file"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = os.path.join(entry, f"rank_{rank}", str(name))
    return path if os.path.isfile(path) else None


@dataclass
class Conversion:
    """What converting one rank of an entry needs."""

    checkpoint: str
    src: StrategyFile | None
    dst: StrategyFile
    output_format: str | None
    entry: str
    say: Callable[[str], None]
    names: NameOptions | None = None
    ready: dict[int, str] = field(default_factory=dict)  # the ranks done so far: {rank: file}

    def rank(self, rank: int) -> str:
        """Convert ``rank`` into the entry (the caller holds its lock) and return its file."""
        work = os.path.join(self.entry, _WORK, f"rank_{rank}")
        final = os.path.join(self.entry, f"rank_{rank}")
        for leftover in (work, final):  # a holder that died left them: they are this entry's own
            shutil.rmtree(leftover, ignore_errors=True)
        os.makedirs(os.path.dirname(work), exist_ok=True)
        api.transform(
            self.checkpoint,
            work,
            self.src,
            self.dst,
            ranks=[rank],
            output=api.OutputSpec(prefix=PREFIX, format=self.output_format),
            destination=api.Destination(manifest=False),
            tensors=api.TensorOptions(names=self.names),
            # said once the plan is made and checked: a refused conversion is its error line alone
            run=api.RunOptions(on_start=lambda _bytes: self.say(f"converting rank {rank} into {self.entry}")),
        )
        produced = os.path.join(work, f"rank_{rank}")
        names = sorted(os.listdir(produced))
        if len(names) != 1:
            raise ReshardError(f"rank {rank}: expected one output file, found {len(names)}", produced)
        _test_pause()
        os.rename(produced, final)
        size = os.path.getsize(os.path.join(final, names[0]))
        os.makedirs(os.path.join(self.entry, _DONE), exist_ok=True)
        facts = {"file": names[0], "bytes": size, "host": _lock.host_name(), "pid": os.getpid(), "at": _now()}
        _write_atomically(_marker(self.entry, rank), json.dumps(facts).encode() + b"\n")
        _log_conversion(self.entry, {"rank": rank, **facts})
        shutil.rmtree(work, ignore_errors=True)
        return os.path.join(final, names[0])


def _test_pause() -> None:
    """TEST ONLY: ``RESHARD_AUTO_TEST_PAUSE=<seconds>`` holds a conversion before it is committed,
    so that a test can kill the converter mid-way and check that another caller takes over."""
    text = os.environ.get(TEST_PAUSE_VARIABLE)
    if text:
        time.sleep(float(text))


def _log_conversion(entry: str, facts: dict[str, object]) -> None:
    """One JSON line per conversion (``O_APPEND``): who converted what, for users and tests."""
    line = (json.dumps(facts) + "\n").encode()
    fd = os.open(os.path.join(entry, CONVERSIONS_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _rank_lock(entry: str, rank: int) -> _lock.DestinationLock:
    root = os.path.join(entry, _LOCKS, f"rank_{rank}")
    os.makedirs(root, exist_ok=True)
    return _lock.DestinationLock(root)


def _try_rank(conversion: Conversion, rank: int) -> str | None:
    """The rank's file if it is done or this caller converted it now; None while another converts it."""
    done = done_file(conversion.entry, rank)
    if done is not None:
        return done
    lock = _rank_lock(conversion.entry, rank)
    if not lock.try_acquire():
        return None
    try:
        return done_file(conversion.entry, rank) or conversion.rank(rank)
    finally:
        lock.release()


def ensure_ranks(conversion: Conversion, ranks: Sequence[int]) -> dict[int, str]:
    """Every rank of ``ranks`` done in the entry: converted here when free, else waited for
    (``conversion.ready`` holds the ranks done so far)."""
    files = conversion.ready
    pending = list(ranks)
    delays = backoff()
    waiting_said = False
    while pending:
        for rank in list(pending):
            path = _try_rank(conversion, rank)
            if path is not None:
                files[rank] = path
                pending.remove(rank)
                delays = backoff()
        if pending:
            if not waiting_said:
                conversion.say(f"waiting for another caller converting rank {ranges(pending)}")
                waiting_said = True
            time.sleep(next(delays))
    return files


# --------------------------------------------------------------------------------------------
# Eviction


@dataclass(frozen=True)
class CachePolicy:
    """When entries leave the cache: larger than ``max_bytes`` in all, or unused for ``max_age`` s."""

    max_bytes: int | None = None
    max_age: float | None = DEFAULT_MAX_AGE_DAYS * 86400

    @classmethod
    def from_environment(cls, max_cache_bytes: int | str | None) -> CachePolicy:
        given = max_cache_bytes if max_cache_bytes is not None else os.environ.get(CACHE_MAX_VARIABLE) or None
        size = parse_size(given, "the cache size limit") if given is not None else None
        days_text = os.environ.get(CACHE_MAX_AGE_VARIABLE)
        try:
            days = float(days_text) if days_text else DEFAULT_MAX_AGE_DAYS
        except ValueError:
            raise UsageError(f"{CACHE_MAX_AGE_VARIABLE} must be a number of days, not {days_text!r}") from None
        return cls(size, days * 86400 if days > 0 else None)


def _entry_size(entry: str) -> int:
    total = 0
    for folder, _, files in os.walk(entry):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _last_used(entry: str) -> float:
    for path in (os.path.join(entry, LAST_USED), entry):
        with contextlib.suppress(OSError):
            return os.stat(path).st_mtime
    return 0.0


def cache_entries(cache_dir: str) -> list[str]:
    """The entries of a cache folder (32-hex-digit folders): the only things eviction removes."""
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return []
    return sorted(os.path.join(cache_dir, n) for n in names if ENTRY_NAME.fullmatch(n))


def evict(cache_dir: str, policy: CachePolicy, keep: Sequence[str] = ()) -> list[str]:
    """Remove entries the policy no longer keeps, oldest use first; returns the removed entries.

    An entry in use (a caller holds its shared lock: converting, waiting or just returned) or named
    in ``keep`` is never touched; a removed entry is first renamed away, so nobody sees it half gone.
    """
    entries = [(e, _last_used(e), _entry_size(e)) for e in cache_entries(cache_dir)]
    total = sum(size for _, _, size in entries)
    now = time.time()
    removed: list[str] = []
    kept = {os.path.abspath(k) for k in keep}
    for entry, used, size in sorted(entries, key=lambda item: item[1]):
        too_old = policy.max_age is not None and now - used > policy.max_age
        too_big = policy.max_bytes is not None and total > policy.max_bytes
        if not (too_old or too_big) or os.path.abspath(entry) in kept:
            continue
        if _remove_entry(cache_dir, entry):
            total -= size
            removed.append(entry)
    return removed


def _remove_entry(cache_dir: str, entry: str, keep_done: bool = False) -> bool:
    """Rename an unused entry away under its exclusive lock, then delete it (False: in use, or with
    ``keep_done`` a rank of it done)."""
    try:
        fd = os.open(os.path.join(entry, IN_USE), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (or no flock here: then nothing is ever evicted)
        os.close(fd)
        return False
    if keep_done and _has_done(entry):  # looked at under the lock: no caller can add one now
        os.close(fd)
        return False
    graveyard = os.path.join(cache_dir, f".evicted-{os.path.basename(entry)}-{_lock.host_name()}-{os.getpid()}")
    try:
        os.rename(entry, graveyard)
    except OSError:
        return False
    finally:
        os.close(fd)
    shutil.rmtree(graveyard, ignore_errors=True)
    return True


# --------------------------------------------------------------------------------------------
# The function


def _check_arguments(
    checkpoint: str,
    dst_strategy: str,
    rank_id: int,
    world_size: int | None,
    output_format: str | None,
    timeout: float | None,
    local_ranks: Sequence[int] | None,
    cache_dir: str,
) -> list[int]:
    """The ranks to convert, after refusing bad arguments (before anything is read or written)."""
    if not isinstance(rank_id, int) or isinstance(rank_id, bool) or rank_id < 0:
        raise UsageError(f"the rank id must be a whole number >= 0, not {rank_id!r}")
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise UsageError(f"the world size must be a whole number >= 1, not {world_size!r}")
    if timeout is not None and not timeout >= 0:
        raise UsageError(f"the timeout must be a number of seconds >= 0, not {timeout!r}")
    if output_format == "checkpoint2":
        raise UnsupportedError(
            "auto_transform returns one file per rank; a Checkpoint 2.0 is one tree for all ranks "
            "(write it with reshard transform --output-format checkpoint2)"
        )
    if output_format is not None:
        registry.check(output_format, "output format")
    ranks = sorted(set(local_ranks)) if local_ranks else [rank_id]
    if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks):
        raise UsageError(f"local ranks must be whole numbers >= 0, not {list(local_ranks or [])}")
    if rank_id not in ranks:
        raise UsageError(f"rank {rank_id} is not one of the local ranks {ranges(ranks)}")
    if world_size is not None and ranks[-1] >= world_size:
        raise UsageError(f"rank {ranks[-1]} is outside the world size {world_size}")
    if not os.path.exists(checkpoint):
        raise UsageError("the checkpoint does not exist", checkpoint)
    _check_cache_place(cache_dir, [checkpoint, dst_strategy])
    return ranks


def _check_cache_place(cache_dir: str, inputs: Sequence[str]) -> None:
    """The cache may not be a file, nor lie in (or hold) an input: nothing is written beside the user's files."""
    cache = os.path.realpath(cache_dir)
    if os.path.exists(cache) and not os.path.isdir(cache):
        raise UsageError("the cache folder exists and is not a folder", cache_dir)
    for given in inputs:
        path = os.path.realpath(given)
        folder = os.path.dirname(path) if path.endswith(".index.json") else path  # an HF index: its folder
        if destination.overlap(cache, [folder]) is not None:
            raise UsageError(f"the cache folder may not lie inside or hold an input ({given})", cache_dir)


def _source_strategy(checkpoint: str, src_strategy: str | None, notes: list[str]) -> StrategyFile | None:
    """The source strategy given, else MindFormers' place for rank folders (docs/formats.md §11.1)."""
    if src_strategy in (None, "", "None", "none"):
        if not needs_strategy(checkpoint):
            return None
        src_strategy = find_source_strategy(checkpoint, "--src-strategy", notes)
    assert src_strategy is not None
    sf = load_strategy(src_strategy)
    notes.extend(sf.notes)
    return sf


def _check_source(checkpoint: str, src: StrategyFile | None) -> None:
    """A source strategy for a kind that carries its layouts or is a full model is refused here, before the wait."""
    resolve(checkpoint, strategy=src)


def auto_transform(
    checkpoint: StrPath,
    dst_strategy: StrPath,
    rank_id: int,
    *,
    src_strategy: StrPath | None = None,
    cache_dir: StrPath | None = None,
    world_size: int | None = None,
    output_format: str | None = None,
    timeout: float | None = None,
    local_ranks: Sequence[int] | None = None,
    max_cache_bytes: int | str | None = None,
    on_note: Callable[[str], None] | None = None,
    names: NameOptions | None = None,
) -> str:
    """The file rank ``rank_id`` of a starting job must load, converted once for all callers.

    Every rank of the job (on every node) calls this at the same moment. The call waits for the
    destination strategy (the job's strategy folder may still be being written), computes the
    cache entry of these inputs, converts this caller's ranks that no other caller converts or has
    converted, waits for the others, and returns ``<cache_dir>/<key>/rank_<rank_id>/checkpoint_<rank_id>.<fmt>``.
    A second start with the same inputs converts nothing. docs/formats.md §14 describes the cache.

    Args:
        checkpoint: Any source ``transform`` reads: a full model file or a folder holding one,
            ``rank_<r>`` folders, a ``unify`` output, a Hugging Face folder, a Checkpoint 2.0 (every path
            argument: a ``str`` or an ``os.PathLike`` such as ``pathlib.Path``).
        dst_strategy: The job's strategy file, or folder of ``ckpt_strategy_rank_<r>.ckpt`` files
            (waited for while its ranks write them; merged in memory, nothing is written there).
        rank_id: The destination rank of this caller.
        src_strategy: The source strategy for rank folders (None: MindFormers' ``strategy`` folder
            beside the checkpoint folder or in its output folder, docs/formats.md §11.1; none for a
            full model).
        cache_dir: The cache folder shared by all callers (None: ``$RESHARD_CACHE``, else
            ``~/.cache/reshard/transformed``).
        world_size: The job's rank count: wait until the strategy folder describes ranks
            ``0 … world_size-1``, a complete file of each pipeline stage (any one of its ranks'; a
            folder of one file per stage is complete at once). None: the stages the files found
            describe; a rank beyond them is refused.
        output_format: ``"ckpt"`` or ``"safetensors"`` (None: the source's).
        timeout: Seconds to wait for the destination strategy (None: 3600).
        local_ranks: The ranks of this node, all converted by this caller when free (None: only
            ``rank_id``); must include ``rank_id``.
        max_cache_bytes: Size limit of the cache, bytes or a size such as ``"500GB"`` (None:
            ``$RESHARD_CACHE_MAX``, else no limit); entries unused for 30 days
            (``$RESHARD_CACHE_MAX_AGE_DAYS``) are removed too.
        on_note: Called with each note for the user as it arises (waiting, converting, the source
            strategy found; None: dropped).
        names: Which tensors to keep and what to call them (``NameOptions``, as ``api.transform``
            takes; part of the cache key). None: every tensor, names kept.

    Returns:
        The path of the file rank ``rank_id`` loads; its folder's parent is the entry, which holds
        ``rank_<r>/`` folders as MindFormers' ``load_checkpoint`` expects.

    Raises:
        UsageError: A missing checkpoint, bad numbers, a cache folder inside an input, rank folders
            without a source strategy, or a destination strategy still incomplete after ``timeout``
            (the line names the pipeline stages whose file is missing).
        UnsupportedError: ``output_format="checkpoint2"`` (one tree for all ranks, not a file each).
        LayoutError: A strategy does not fit the tensors, ``world_size``, or ``rank_id``.
        FormatError: A source or strategy file that is truncated, corrupted or not what it claims.
        ReshardError: The cache cannot be written (a full disk, say).

    Example:
        from reshard.auto import auto_transform
        path = auto_transform("demo/ckpt_8ranks", "demo/strategy_4", 0, src_strategy="demo/strategy_8",
                              cache_dir="cache")
    """
    checkpoint, dst_strategy = arguments.path(checkpoint, "checkpoint"), arguments.path(dst_strategy, "dst_strategy")
    src_strategy, cache_dir = (
        arguments.optional_path(src_strategy, "src_strategy"),
        arguments.optional_path(cache_dir, "cache_dir"),
    )
    say = on_note or (lambda _note: None)
    cache = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()
    ranks = _check_arguments(checkpoint, dst_strategy, rank_id, world_size, output_format, timeout, local_ranks, cache)
    policy = CachePolicy.from_environment(max_cache_bytes)
    found: list[str] = []
    src = _source_strategy(checkpoint, src_strategy, found)
    for note in found:
        say(note)
    _check_source(checkpoint, src)
    dst = wait_for_strategy(dst_strategy, world_size, DEFAULT_TIMEOUT if timeout is None else timeout, say)
    total = ranks_of(dst)
    if ranks[-1] >= total:
        hint = "" if world_size is not None else " (while the job still writes its strategy files, give world_size)"
        raise LayoutError(
            f"rank {ranks[-1]} is outside the {total} ranks of the destination strategy{hint}", dst_strategy
        )
    key, facts = cache_key(checkpoint, src, dst, output_format, names)
    conversion = Conversion(checkpoint, src, dst, output_format, os.path.join(cache, key), say, names)
    return _convert(conversion, ranks, facts, policy)[rank_id]


def _convert(
    conversion: Conversion, ranks: Sequence[int], facts: dict[str, object], policy: CachePolicy
) -> dict[int, str]:
    """``ranks`` done in the conversion's entry, then the cache trimmed.

    A refused conversion (a ``ReshardError``: the source and strategies do not fit, say) leaves no
    entry of its own behind: one with no rank done is removed, as eviction removes one, unless
    another caller uses it (the last one out removes it), and the cache folder this call made, if
    empty. An interrupt keeps the entry (a restart takes its unfinished ranks over) and says so.
    """
    entry = conversion.entry
    cache = os.path.dirname(entry)
    made_cache = not os.path.isdir(cache)
    try:
        with entry_in_use(entry):
            _describe_entry(entry, facts)
            files = ensure_ranks(conversion, ranks)
            _touch(os.path.join(entry, LAST_USED))
            evict(cache, policy, keep=[entry])
    except KeyboardInterrupt as exc:
        interrupts.explain(exc, _interrupted(conversion, ranks))
        raise
    except ReshardError:
        _drop_unused(cache, entry, made_cache)
        raise
    return files


def _interrupted(conversion: Conversion, ranks: Sequence[int]) -> str:
    """What an interrupted start leaves: the ranks ready in the entry, and what starting again does."""
    ready = sorted(r for r in ranks if r in conversion.ready)
    if len(ranks) == 1:
        have = f"rank {ranks[0]} {'ready' if ready else 'not ready yet'}"
    elif ready:
        have = f"rank{'s' if len(ready) > 1 else ''} {ranges(ready)} of ranks {ranges(ranks)} ready"
    else:
        have = f"none of ranks {ranges(ranks)} ready yet"
    then = (
        "converts nothing and prints the file" if len(ready) == len(ranks) else "takes over the unfinished conversion"
    )
    return f"{have} in the cache entry {conversion.entry}; start it again: it {then}"


def _has_done(entry: str) -> bool:
    try:
        return bool(os.listdir(os.path.join(entry, _DONE)))
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: keep it


def _drop_unused(cache: str, entry: str, made_cache: bool) -> None:
    """Remove an entry no rank of which is done and no caller uses (and the cache folder made for it)."""
    if _remove_entry(cache, entry, keep_done=True) and made_cache:
        with contextlib.suppress(OSError):
            os.rmdir(cache)  # only when empty: another caller's entry keeps it


def _describe_entry(entry: str, facts: dict[str, object]) -> None:
    """``entry.json``: what the entry was made from (for people; nothing reads it back)."""
    path = os.path.join(entry, ENTRY_INFO)
    if not os.path.exists(path):
        _write_atomically(path, json.dumps({**facts, "created": _now()}, indent=1).encode() + b"\n")


def _touch(path: str) -> None:
    with open(path, "a", encoding="utf-8"):
        pass
    os.utime(path)


__all__ = [
    "CACHE_MAX_AGE_VARIABLE",
    "CACHE_MAX_VARIABLE",
    "CACHE_VARIABLE",
    "DEFAULT_TIMEOUT",
    "SETTLE_VARIABLE",
    "TEST_PAUSE_VARIABLE",
    "CachePolicy",
    "Conversion",
    "StrategyWait",
    "auto_transform",
    "cache_entries",
    "cache_key",
    "default_cache_dir",
    "done_file",
    "ensure_ranks",
    "entry_in_use",
    "evict",
    "file_identity",
    "source_files",
    "wait_for_strategy",
]
