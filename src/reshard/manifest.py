"""Completion manifest, resume journal and roll-back of one run (``reshard.api`` operations).

Why it is built this way:

* Every output is written under a temporary name and renamed into place
  (``formats.base.atomic_path``), so each output path holds nothing, an older file, or a complete
  new file. What a path cannot say by itself is whether the file in place is *this* run's. The
  journal says it: once an output is renamed into place, its size, checksum and a fingerprint of
  what produced it are appended as one JSON line to ``DST/.reshard-journal``. A run killed at any
  moment (``kill -9``) leaves at worst a torn last line, which is ignored.
* ``resume=True`` keeps exactly the outputs whose journal line matches the file on disk (same
  fingerprint, size and a re-read hash) and rewrites everything else, so the result is
  byte-identical to an uninterrupted run. The fingerprint covers the file's plan (tensors, boxes,
  source paths), the sources' sizes and modification times, and the write options (crc trailer,
  chunk size, encryption mode and a key id), so resuming with other inputs, options or key never
  keeps a stale file. Temporary files of the killed run are removed. A finishing file (``plan.texts``:
  an index, ``.metadata``) already holding this plan's bytes is kept too, not rewritten. It continues
  only a run planned the same way: the journal's first line (and the manifest) hold the plan's
  fingerprint, compared before anything changes (``reshard.resume``), so the earlier run's other
  files never stay beside a differently planned output.
* The manifest ``DST/reshard-manifest.json`` is written last, atomically, as the completion
  marker: the operation, the sources, and each output's size and checksum (XXH128 by default, BLAKE3
  or SHA-256 on request: ``execute.digest`` says why; the JSON key names the algorithm). It holds no timestamp,
  so a resumed run writes the same bytes as an uninterrupted one; the journal is removed after it.
  A run into a destination first removes an older manifest, so a destination never shows a
  manifest while its files are being replaced.
* Hashing costs one read of each output (from the page cache; XXH128 31 GB/s per core here). The executor
  hashes each plain output while writing it (``execute.digest``: a hash thread follows the finished
  prefix of the file), so the hash is ready moments after the last byte; outputs it could not hash
  that way (encrypted ones, the Ray executor's) are read back on hash threads while later files are
  still being copied.
* One run per destination: ``RunRecorder.start`` takes the destination's lock (``reshard.lock``)
  before it touches anything, and a run that cannot get it changes nothing there.
* ``--overwrite`` with fewer ranks removes the earlier run's outputs (as its manifest or journal
  lists them) that the new layout no longer has (``superseded_outputs``), after the lock is taken.
* A run that fails with an error rolls back: the outputs, folders, journal and temporary files it
  created are removed, so a bad input or a full disk leaves the destination as it was. (Files that
  ``overwrite`` already replaced cannot be restored; they are complete.) An interrupted run
  (Ctrl-C, kill) keeps its finished files for ``resume``.

No fsync: the journal protects against a killed process, not against power loss (an output the
kernel has not written back is no safer than its journal line).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from reshard import __version__, interrupts
from reshard import resume as resume_check
from reshard.errors import ReshardError, UsageError
from reshard.execute import hooks, local
from reshard.execute.digest import ALGORITHMS, DEFAULT_ALGORITHM, check_algorithm, file_digest, new_hash
from reshard.execute.options import KEEP_FINISHED, RunOptions, WriteOptions
from reshard.formats import crypto, rank_dirs, registry
from reshard.formats.base import JOURNAL_NAME, TEMP_SUFFIX, atomic_path, holds
from reshard.lock import DestinationLock
from reshard.plan import FilePlan, Plan
from reshard.plan.validate import validate_plan
from reshard.text import RESUME, indefinite

MANIFEST_NAME = "reshard-manifest.json"
MANIFEST_VERSION = 1
_KEY_ID_CONTEXT = b"reshard key id\x00"  # the key id is a hash of this and the key, never the key


@dataclass(frozen=True)
class RunProgress:
    """How far an interrupted run got: attached to the ``KeyboardInterrupt`` as ``reshard_progress``.

    ``completed`` counts the outputs in place and journaled (kept from an earlier run or written by
    this one) of the ``total`` the plan writes; ``resumable`` is False without a journal
    (``manifest=False``), when ``resume`` cannot tell finished files from others; ``complete``: the
    run had committed (its manifest in place, or every output written without one) when it was
    interrupted, so nothing is left to do.
    """

    completed: int
    total: int
    resumable: bool
    complete: bool = False


PROGRESS_ATTRIBUTE = "reshard_progress"


@dataclass(frozen=True)
class OutputRecord:
    """One completed output: path relative to the destination root, size, checksum, fingerprint."""

    path: str
    size: int
    checksum: str
    fingerprint: str = ""
    algorithm: str = DEFAULT_ALGORITHM  # the checksum's algorithm, its key in the JSON

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "bytes": self.size, self.algorithm: self.checksum}
        if self.fingerprint:
            doc["fingerprint"] = self.fingerprint
        return doc

    @classmethod
    def from_json(cls, item: Any) -> OutputRecord:
        """Raises ValueError/KeyError/TypeError on anything that is not a record."""
        algorithm = next((a for a in ALGORITHMS if a in item), None)
        if algorithm is None:
            raise KeyError("no checksum")
        return cls(
            str(item["path"]), int(item["bytes"]), str(item[algorithm]), str(item.get("fingerprint", "")), algorithm
        )


def key_id(key: bytes) -> str:
    """A short id of a key for fingerprints (SHA-256: reveals nothing usable about the key)."""
    import hashlib  # OpenSSL, loaded only by runs that encrypt

    return hashlib.sha256(_KEY_ID_CONTEXT + bytes(key)).hexdigest()[:16]


def write_facts(write: WriteOptions) -> dict[str, Any]:
    """The write options that change output bytes."""
    encrypted = write.enc_key is not None
    return {
        "crc": write.write_crc,
        "chunk_bytes": write.chunk_bytes,
        "enc_mode": write.enc_mode if encrypted else None,
        "key": key_id(write.enc_key) if write.enc_key is not None else None,
    }


def _stat(path: str, cache: dict[str, Any]) -> Any:
    if path not in cache:
        try:
            st = os.stat(path)
            cache[path] = [st.st_size, st.st_mtime_ns]
        except OSError:
            cache[path] = None
    return cache[path]


def file_fingerprint(file: FilePlan, plan: Plan, facts: dict[str, Any], stats: dict[str, Any]) -> str:
    """XXH128 of everything that decides the bytes of ``file`` (a fingerprint, not a secret: the
    checksum's own hash, already loaded, where SHA-256 would load OpenSSL for a few kilobytes)."""
    return _fingerprints(file, plan, facts, stats)[0]


def _fingerprints(file: FilePlan, plan: Plan, facts: dict[str, Any], stats: dict[str, Any]) -> tuple[str, str]:
    """``file_fingerprint``, and that of the file's layout alone (format, metadata, each tensor's name,
    dtype, shape and size: what ``reshard.resume`` compares), from one walk of its tensors."""
    tensors, layout = [], []
    used: set[str] = set()
    for t in file.tensors:
        copies = [
            [plan.sources[c.source], c.tensor, c.src_start, c.dst_start, c.lengths]
            + ([c.src_view] if c.src_view is not None or c.src_perm is not None else [])
            + ([c.src_perm] if c.src_perm is not None else [])
            for c in t.copies
        ]
        used.update(plan.sources[c.source] for c in t.copies)
        literal = _xxh128(t.literal) if t.literal is not None else None
        head = [t.name, t.dtype.ms_name, t.shape, t.nbytes]
        layout.append(head)
        tensors.append([*head, literal, copies])
    doc = {
        "format": file.format,
        "metadata": file.metadata,
        "tensors": tensors,
        "sources": {p: _stat(p, stats) for p in sorted(used)},
        "write": facts,
    }
    shape = {"format": file.format, "metadata": file.metadata, "tensors": layout}
    return _xxh128(json.dumps(doc, sort_keys=True).encode()), _xxh128(json.dumps(shape, sort_keys=True).encode())


def _xxh128(data: bytes) -> str:
    digest = new_hash("xxh128")
    digest.update(data)
    return str(digest.hexdigest())


def common_root(plan: Plan) -> str:
    """The folder holding every output of ``plan`` (the destination when none is given)."""
    dirs = [os.path.dirname(os.path.abspath(p)) for p in [f.path for f in plan.files] + [t.path for t in plan.texts]]
    return os.path.commonpath(dirs) if dirs else os.getcwd()


def journal_path(root: str) -> str:
    return os.path.join(root, JOURNAL_NAME)


def manifest_path(root: str) -> str:
    return os.path.join(root, MANIFEST_NAME)


def has_unfinished_run(root: str) -> bool:
    """True when ``root`` holds the journal of a run that did not finish."""
    return os.path.isfile(journal_path(root))


def relative(path: str, root: str) -> str:
    """``path`` as the journal and the manifest name it: relative to ``root`` (absolute), ``/``
    separated; unchanged when it lies outside ``root``."""
    rel = os.path.relpath(os.path.abspath(path), root)
    return path if rel.startswith(os.pardir) else rel.replace(os.sep, "/")


def read_journal(root: str) -> dict[str, OutputRecord]:
    """Journal entries by relative path (the last entry of a path wins; torn lines are skipped).

    A finished run has no journal; its manifest's entries (which carry the same fingerprints)
    stand in, so resuming a finished run keeps everything.
    """
    try:
        with open(journal_path(root), "rb") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return _manifest_records(root)
    return _journal_records(lines)


def earlier_run(root: str) -> resume_check.EarlierRun | None:
    """What the run recorded in ``root`` planned: its journal's (unfinished), else its manifest's
    (finished); None when ``root`` holds neither."""
    try:
        with open(journal_path(root), "rb") as fh:
            lines = fh.read().splitlines()
    except OSError:
        try:
            return resume_check.from_manifest(read_manifest(root))
        except UsageError:
            return None
    return resume_check.from_journal(lines, _journal_records(lines))


def _journal_records(lines: list[bytes]) -> dict[str, OutputRecord]:
    """The output records among a journal's lines (its first line and torn lines are none)."""
    records: dict[str, OutputRecord] = {}
    for line in lines:
        try:
            record = OutputRecord.from_json(json.loads(line))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a torn or foreign line: that output is simply redone
        records[record.path] = record
    return records


def _manifest_records(root: str) -> dict[str, OutputRecord]:
    try:
        outputs = read_manifest(root)["outputs"]
        records = [OutputRecord.from_json(item) for item in outputs]
    except (ReshardError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    return {r.path: r for r in records if r.fingerprint}


def read_manifest(root: str) -> dict[str, Any]:
    """The manifest of a finished run in ``root`` (UsageError when absent or unreadable)."""
    path = manifest_path(root)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"no readable manifest: {getattr(exc, 'strerror', None) or exc}", path) from None
    if not isinstance(data, dict) or data.get("reshard_manifest") != MANIFEST_VERSION:
        raise UsageError("not a reshard manifest", path)
    return data


def stale_temp_files(paths: Iterable[str]) -> list[str]:
    """Temporary files that an interrupted write of any of ``paths`` may have left."""
    found: list[str] = []
    for path in paths:
        folder, name = os.path.split(os.path.abspath(path))
        pattern = os.path.join(glob.escape(folder), glob.escape(f".{name}.") + "*" + TEMP_SUFFIX)
        found.extend(glob.glob(pattern))
    return found


def previous_outputs(root: str) -> set[str]:
    """Relative paths of the outputs an earlier run wrote into ``root``: its manifest and its journal."""
    listed: set[str] = set()
    with contextlib.suppress(ReshardError, KeyError, TypeError, AttributeError):
        listed.update(str(item["path"]) for item in read_manifest(root)["outputs"])
    with contextlib.suppress(OSError), open(journal_path(root), "rb") as fh:
        for line in fh.read().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                listed.add(OutputRecord.from_json(json.loads(line)).path)
    return listed


def superseded_outputs(root: str, plan: Plan, rank_total: int) -> list[str]:
    """Files an ``overwrite`` run into ``root`` must remove so the next read sees only its outputs.

    They are the files an earlier reshard run wrote (its manifest or journal lists them) in the
    ``rank_<r>`` folders this run writes (besides this run's own outputs), and in every ``rank_<r>``
    folder with ``r`` beyond this layout's ``rank_total`` ranks (8 ranks overwritten by 4). Folders of
    ranks inside the layout that this run does not write (``--ranks``: another node's share) are left
    alone. A checkpoint file there that reshard did not write would be read as part of the output:
    ``UsageError`` naming it, before anything is written. Nothing reshard did not write is removed.
    """
    if not os.path.isdir(root):
        return []
    root = os.path.abspath(root)
    ours = {os.path.abspath(f.path) for f in plan.files}
    written_ranks = {f.rank for f in plan.files if f.rank is not None}
    listed = {os.path.normpath(os.path.join(root, rel)) for rel in previous_outputs(root)}
    doomed: list[str] = []
    for rank, folder in rank_dirs.rank_dirs(root).items():
        if rank < rank_total and rank not in written_ranks:
            continue
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if path in ours:
                continue
            if os.path.isfile(path) and (path in listed or (rank >= rank_total and name.endswith(TEMP_SUFFIX))):
                doomed.append(path)
            elif name.endswith((".ckpt", ".safetensors")):
                raise UsageError(
                    "reshard did not write this checkpoint, and the next read would take it for part "
                    "of this output; move it away or choose another destination",
                    path,
                )
            elif rank >= rank_total:
                raise UsageError(
                    f"reshard did not write this, so rank_{rank}/ would stay beside {indefinite(rank_total)}-rank "
                    "output and the next read would take it for a rank folder; move it away or choose "
                    "another destination",
                    path,
                )
    return doomed


def check_write_options(plan: Plan, write: WriteOptions) -> None:
    """Refuse option combinations before a byte is written."""
    if write.enc_key is None:
        return
    crypto.check_key(write.enc_key, write.enc_mode)
    if write.write_crc:
        raise UsageError("a crc trailer and encryption are mutually exclusive (as in MindSpore)")
    plain = [f for f in plan.files if not registry.get(f.format).encrypts]
    if plain:
        ext = registry.suffix(plain[0].format)
        raise UsageError(f"only .ckpt outputs can be encrypted; this run writes {ext}", plain[0].path)


class RunRecorder:
    """Journal, manifest and roll-back around one execution of a plan into ``root``."""

    def __init__(
        self, plan: Plan, root: str, write: WriteOptions, *, resume: bool, manifest: bool, remove: Sequence[str] = ()
    ) -> None:
        if resume and not manifest:
            raise UsageError("resume needs the journal, which is only kept with manifest=True")
        self.plan = plan
        self.root = os.path.abspath(root)
        self.write = write
        self.algorithm = write.checksum
        check_algorithm(write.checksum)  # an unknown algorithm is refused before anything is written
        self.resume = resume
        self.manifest = manifest
        self.records: dict[str, OutputRecord] = {}
        self._fingerprints: dict[str, str] = {}
        self._lock = threading.Lock()
        self._hasher: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._pending_lock = threading.Lock()
        self._existed: set[str] = set()
        self._new_dirs: list[str] = []
        self._journal: Any = None
        self.kept: list[str] = []  # relative paths of outputs verified and kept from an earlier run
        self.kept_texts: list[str] = []  # finishing files (plan.texts) a resume found holding their bytes
        self._plan_fingerprint = ""  # what the plan writes (reshard.resume), journaled and in the manifest
        self._written = 0  # outputs renamed into place by this run
        self.remove = tuple(remove)  # an earlier run's outputs this one supersedes (superseded_outputs)
        self._dest_lock = DestinationLock(self.root)
        self._locked = False  # nothing in the destination is touched (not even rolled back) without it
        self._manifest_started = False  # finish began writing the manifest
        self.committed = False  # finish returned: every output, text and the manifest are in place

    # ------------------------------------------------------------------ paths

    def rel(self, path: str) -> str:
        return relative(path, self.root)

    def _own_files(self) -> list[str]:
        outputs = [f.path for f in self.plan.files] + [t.path for t in self.plan.texts]
        return [os.path.abspath(p) for p in outputs] + [journal_path(self.root), manifest_path(self.root)]

    def _snapshot(self) -> None:
        """Remember what exists, to undo exactly what this run creates if it fails."""
        own = self._own_files()
        self._existed = {p for p in own if os.path.lexists(p)}
        new_dirs: set[str] = set()
        for path in own:
            folder = os.path.dirname(path)
            while folder and not os.path.isdir(folder) and folder not in new_dirs:
                new_dirs.add(folder)
                folder = os.path.dirname(folder)
        self._new_dirs = sorted(new_dirs, key=len, reverse=True)

    # ------------------------------------------------------------------ start

    def start(self) -> Plan:
        """Lock and prepare the destination; return the plan restricted to the files still to write."""
        self._snapshot()
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create the destination folder: {exc.strerror or exc}", self.root) from None
        self._dest_lock.acquire()  # another run writing here: UsageError naming it, nothing touched
        try:
            if self.manifest:
                self._fingerprint_plan()
            if self.resume:
                self._check_same_plan()  # before anything here changes: a refusal leaves it all as it was
        except BaseException:
            self._dest_lock.release()
            raise
        self._locked = True
        self._existed = {p for p in self._own_files() if os.path.lexists(p)}  # as the lock found them
        self._remove_superseded()
        for tmp in stale_temp_files(self._own_files()):
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if not self.manifest:
            return self.plan
        kept = self._kept_files() if self.resume else {}
        self._remove(manifest_path(self.root))
        self._open_journal(kept)
        self.records.update(kept)
        # Outputs the executor did not hash while writing them are read back on every core while
        # later files are still being copied (hashlib releases the GIL).
        self._hasher = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="reshard-hash")
        self.kept = sorted(kept)
        todo = tuple(f for f in self.plan.files if self.rel(f.path) not in kept)
        whole = [self.resume and holds(t.path, t.text) for t in self.plan.texts]  # left as they are
        self.kept_texts = [self.rel(t.path) for t, same in zip(self.plan.texts, whole, strict=True) if same]
        texts = tuple(t for t, same in zip(self.plan.texts, whole, strict=True) if not same)
        return replace(self.plan, files=todo, texts=texts)

    def _fingerprint_plan(self) -> None:
        """Each output's fingerprint (its journal line's), and the plan's (``reshard.resume``)."""
        facts, stats, layouts = write_facts(self.write), dict[str, Any](), dict[str, str]()
        for f in self.plan.files:
            self._fingerprints[f.path], layouts[self.rel(f.path)] = _fingerprints(f, self.plan, facts, stats)
        texts = {self.rel(t.path): t.text for t in self.plan.texts}
        self._plan_fingerprint = resume_check.plan_fingerprint(layouts, texts)

    def _outputs(self) -> list[str]:
        return [self.rel(p) for p in [f.path for f in self.plan.files] + [t.path for t in self.plan.texts]]

    def _check_same_plan(self) -> None:
        """A resume continues only a run planned as this one (``reshard.resume``): UsageError otherwise."""
        earlier = earlier_run(self.root)
        why = resume_check.refusal(earlier, self._plan_fingerprint, self._outputs()) if earlier else None
        if why is not None:
            raise UsageError(why, self.root)

    def _remove_superseded(self) -> None:
        """Remove an earlier run's outputs that this run replaces with fewer, and their emptied folders."""
        for path in self.remove:
            self._remove(path)
        for folder in sorted({os.path.dirname(p) for p in self.remove}, reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only when empty: a folder this run writes into is refilled anyway

    def _kept_files(self) -> dict[str, OutputRecord]:
        """Journal entries whose file is on disk with the same fingerprint, size and hash."""
        journal = read_journal(self.root)
        kept: dict[str, OutputRecord] = {}
        for f in self.plan.files:
            rel = self.rel(f.path)
            entry = journal.get(rel)
            if entry is None or entry.fingerprint != self._fingerprints[f.path]:
                continue
            try:
                if os.path.getsize(f.path) != entry.size or (
                    file_digest(f.path, entry.algorithm) != (entry.size, entry.checksum)
                ):
                    continue
            except OSError:
                continue
            kept[rel] = entry
        return kept

    def _open_journal(self, kept: dict[str, OutputRecord]) -> None:
        """A fresh journal holding the kept entries (rewritten atomically: no torn lines carried over)."""
        path = journal_path(self.root)
        try:
            with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
                fh.write(resume_check.journal_header(self._plan_fingerprint, self._outputs()))
                for record in kept.values():
                    fh.write(self._line(record))
            self._journal = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run
        except OSError as exc:
            raise ReshardError(f"cannot write the journal: {exc.strerror or exc}", path) from None

    @staticmethod
    def _line(record: OutputRecord) -> str:
        return json.dumps({**record.to_json(), "fingerprint": record.fingerprint}) + "\n"

    # ------------------------------------------------------------------ during the run

    def written(self, file: FilePlan, digest: str | None = None) -> None:
        """Executor callback: ``file`` was renamed into place; journal it with its checksum.

        ``digest`` is the hash the executor computed while writing; without it the file is read
        back on a hash thread.
        """
        with self._lock:
            self._written += 1
        if self._hasher is None:
            return
        self._raise_hash_errors(wait=False)
        if digest is not None:
            self._record(file, digest)
            return
        future = self._hasher.submit(self._record, file)
        with self._pending_lock:  # worker threads call this concurrently
            self._pending.append(future)

    def _record(self, file: FilePlan, digest: str | None = None) -> None:
        try:
            size, digest = (os.path.getsize(file.path), digest) if digest else file_digest(file.path, self.algorithm)
        except OSError as exc:
            raise ReshardError(f"cannot read back the output: {exc.strerror or exc}", file.path) from None
        record = OutputRecord(self.rel(file.path), size, digest, self._fingerprints[file.path], self.algorithm)
        with self._lock:
            self.records[record.path] = record
            try:
                self._journal.write(self._line(record))
                self._journal.flush()
            except OSError as exc:
                raise ReshardError(
                    f"cannot write the journal: {exc.strerror or exc}", journal_path(self.root)
                ) from None

    def _raise_hash_errors(self, wait: bool) -> None:
        with self._pending_lock:
            ready = [f for f in self._pending if wait or f.done()]
            self._pending = [f for f in self._pending if f not in ready]
        for future in ready:
            future.result()

    # ------------------------------------------------------------------ end

    def finish(self) -> None:
        """Wait for the hashes, write the manifest last, drop the journal."""
        if not self.manifest:
            return
        self._raise_hash_errors(wait=True)
        self._stop()
        for text in self.plan.texts:
            size, digest = file_digest(text.path, self.algorithm)
            self.records[self.rel(text.path)] = OutputRecord(self.rel(text.path), size, digest, "", self.algorithm)
        missing = [self.rel(f.path) for f in self.plan.files if self.rel(f.path) not in self.records]
        if missing:
            raise ReshardError(f"outputs were not recorded: {', '.join(missing)}", self.root)
        path = manifest_path(self.root)
        document = self.manifest_text()
        self._manifest_started = True  # from here a manifest in place is this run's (start removed any other)
        try:
            with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
                fh.write(document)
                fh.flush()
                interrupts.reached("manifest")
        except OSError as exc:
            raise ReshardError(f"cannot write the manifest: {exc.strerror or exc}", path) from None
        self._remove(journal_path(self.root))

    def manifest_text(self) -> str:
        sources = []
        for src in self.plan.sources:
            try:
                sources.append({"path": src, "bytes": os.path.getsize(src)})
            except OSError:
                sources.append({"path": src, "bytes": None})
        doc = {
            "reshard_manifest": MANIFEST_VERSION,
            "reshard_version": __version__,
            "operation": self.plan.operation,
            "complete": True,
            "crc": self.write.write_crc,
            "encryption": self.write.enc_mode if self.write.enc_key is not None else None,
            "checksum": self.algorithm,
            "plan": self._plan_fingerprint,
            "sources": sources,
            "outputs": [self.records[k].to_json() for k in sorted(self.records)],
        }
        return json.dumps(doc, indent=1) + "\n"

    def _stop(self, cancel: bool = True) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True, cancel_futures=cancel)
            self._hasher = None
        if self._journal is not None:
            with contextlib.suppress(OSError):
                self._journal.close()
            self._journal = None

    def rollback(self) -> None:
        """Remove what this run created (outputs, temp files, journal, folders); keep what existed.

        Without the lock (another run holds the destination) only folders this run created and
        left empty are removed: the files there are the other run's.
        """
        self._stop()
        if self._locked:
            own = self._own_files()
            doomed = [p for p in own if p not in self._existed] + stale_temp_files(own)
            for path in doomed:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self.release()  # the lock file goes before the folders it may keep from being empty
        for folder in self._new_dirs:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only when empty

    def interrupted(self) -> RunProgress | None:
        """Stop without undoing: finished files are journaled (pending hashes complete) for ``resume``.

        The executor has stopped (its threads joined), so temporary files of the plan's outputs
        are leftovers; they are removed. Returns how far the run got (None: it had not locked the
        destination yet, so nothing was written).
        """
        started = self._locked or self.committed
        with contextlib.suppress(BaseException):
            self._stop(cancel=False)
        with contextlib.suppress(BaseException):
            for tmp in stale_temp_files(self._own_files()) if self._locked else ():
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        self.release()
        if not started:
            return None
        total = len(self.plan.files)
        return RunProgress(min(total, len(self.kept) + self._written), total, self.manifest, self._complete())

    def _complete(self) -> bool:
        """Whether the run had committed: its manifest in place (the journal is then redundant), or,
        without a manifest, every output and text written."""
        if not self.manifest:
            return self.committed
        if not (self._manifest_started and os.path.exists(manifest_path(self.root))):
            return False
        with contextlib.suppress(OSError):
            os.unlink(journal_path(self.root))  # finish was cut short between the manifest and this
        return True

    def finished_any(self) -> bool:
        """Whether some output is in place and journaled (written now, or kept from an earlier run)."""
        return bool(self.kept) or self._written > 0

    def release(self) -> None:
        """Let go of the destination lock (idempotent)."""
        self._locked = False
        with contextlib.suppress(OSError):
            self._dest_lock.release()

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ReshardError(f"cannot remove: {exc.strerror or exc}", path) from None


def _disk_full(exc: BaseException) -> bool:
    """Whether a write failed for want of space (the OSError itself, or the one a writer's one-line error wraps)."""
    cause = exc if isinstance(exc, OSError) else exc.__cause__
    return isinstance(cause, OSError) and cause.errno == errno.ENOSPC


def _mark(exc: BaseException, progress: RunProgress | None) -> None:
    """Attach how far a stopped run got to what stopped it (``PROGRESS_ATTRIBUTE``)."""
    if progress is not None:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(exc, PROGRESS_ATTRIBUTE, progress)


def run_recorded(
    plan: Plan,
    opener: local.Opener,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
    root: str | None = None,
    *,
    resume: bool = False,
    manifest: bool = True,
    runner: Callable[[Plan, WriteOptions, RunOptions], None] | None = None,
    remove: Sequence[str] = (),
) -> list[str]:
    """Execute ``plan`` with journal, manifest (``manifest=True``) and roll-back on errors.

    ``runner(plan, write, run)`` executes the outputs still to write (default: the local executor
    with ``opener``; the Ray executor passes its own). ``remove``: an earlier run's outputs to delete
    once the destination is locked (``superseded_outputs``). Returns the relative paths of the
    outputs kept from an earlier run (``resume``): its finished files, then the finishing files
    (``plan.texts``) that already held this plan's bytes and were left as they are.
    """
    write, run = write or WriteOptions(), run or RunOptions()
    check_write_options(plan, write)
    validate_plan(plan)  # a planner bug is an internal error before the destination is touched
    recorder = RunRecorder(plan, root or common_root(plan), write, resume=resume, manifest=manifest, remove=remove)
    execute = runner or (lambda todo, todo_write, todo_run: local.run_plan(todo, opener, todo_write, todo_run))
    written = hooks.FileWritten(hooks.full_disk(recorder.written), run.on_file_written)  # ours, then the caller's
    try:
        interrupts.reached("planned")
        todo = recorder.start()
        execute(todo, write, replace(run, on_file_written=written, hash_outputs=manifest or run.hash_outputs))
        interrupts.reached("before-manifest")
        with interrupts.deferred():  # waits for hash threads: no signal inside their locking
            recorder.finish()
        recorder.committed = True
        interrupts.note_completed(RunProgress(len(plan.files), len(plan.files), manifest, complete=True))
        recorder.release()
        interrupts.reached("committed")
    except Exception as exc:
        if getattr(exc, KEEP_FINISHED, False) or written.stopped_by_user(exc):  # a lost node, the caller's hook:
            _mark(exc, recorder.interrupted())  # finished outputs stay for --resume
            raise
        progress = recorder.interrupted() if manifest and _disk_full(exc) and recorder.finished_any() else None
        if progress is not None:  # the finished files are journaled: --resume goes on from them
            raise ReshardError(
                f"no space left on the device: {progress.completed} of {progress.total} files are finished and kept; "
                f"free some space, then run the same command again with {RESUME}",
                exc.filename if isinstance(exc, OSError) else getattr(exc, "path", None),
            ) from None
        recorder.rollback()
        if isinstance(exc, OSError):
            raise ReshardError(f"write failed: {exc.strerror or exc}", exc.filename) from None
        raise
    except BaseException as exc:  # Ctrl-C, SIGTERM, SIGHUP (the CLI raises KeyboardInterrupt for them)
        _mark(exc, recorder.interrupted())
        raise
    return recorder.kept + recorder.kept_texts


__all__ = [
    "JOURNAL_NAME",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "PROGRESS_ATTRIBUTE",
    "OutputRecord",
    "RunProgress",
    "RunRecorder",
    "check_write_options",
    "common_root",
    "earlier_run",
    "file_fingerprint",
    "has_unfinished_run",
    "journal_path",
    "key_id",
    "manifest_path",
    "previous_outputs",
    "read_journal",
    "read_manifest",
    "relative",
    "run_recorded",
    "stale_temp_files",
    "superseded_outputs",
    "write_facts",
]
