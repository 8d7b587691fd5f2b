"""Whether ``--resume`` may continue the run a destination holds: only the one planned the same way.

Why it exists: a resume keeps the earlier run's finished files whose journal lines match and writes
the rest of *its own* plan. Given other options (``--dcp-ranks 2`` after ``--dcp-ranks 3``, another
``--dst-iteration``) it once did just that, and the earlier run's other files stayed beside the new
output, listed in no manifest: a ``__2_0.distcp`` in a 2-rank checkpoint, a half-written
``iter_0000500`` beside ``iter_0000600``. So a run records, before it writes anything, one
fingerprint of what its plan writes: each output file's path, format, metadata and tensors (name,
dtype, shape, size: its layout), and each finishing file's path and bytes (indexes, ``.metadata``,
markers). It goes into the journal's first line and into the manifest. A ``--resume`` compares it
with its own plan's before anything in the destination changes and refuses a difference in one
line; every file there is left as it is (it may be the user's).

Not in it, because they change no output's name or layout and the per-file fingerprints
(``manifest.file_fingerprint``) already redo every file they touch: the sources' paths, sizes and
times, and the write options (crc trailer, encryption and key, checksum).

A journal or manifest of an earlier reshard holds no fingerprint; its outputs (a journal's finished
files, a manifest's list) are compared with this plan's instead: an output this run does not write
is exactly what would go stale. The journal's first line is no output record, so an earlier reshard
reading a newer journal skips it as it skips a torn line.

Pure: ``reshard.manifest`` reads the journal and the manifest and hands their contents here.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reshard.execute.digest import new_hash
from reshard.text import RESUME

JOURNAL_HEADER = "reshard_journal"  # the key of the journal's first line; its value is the version
JOURNAL_VERSION = 1


@dataclass(frozen=True)
class EarlierRun:
    """What the run recorded in a destination planned: its fingerprint (None: recorded by a reshard
    without one) and its outputs' relative paths; ``finished``: it completed (its manifest)."""

    fingerprint: str | None
    outputs: frozenset[str]
    finished: bool = False


def plan_fingerprint(layouts: Mapping[str, str], texts: Mapping[str, str | bytes]) -> str:
    """XXH128 of a plan's outputs: ``layouts`` (relative path -> the file's layout fingerprint) and
    ``texts`` (relative path -> the finishing file's content), in path order."""
    digest = new_hash("xxh128")
    for rel in sorted(layouts):
        digest.update(json.dumps(["file", rel, layouts[rel]]).encode() + b"\n")
    for rel in sorted(texts):
        data = texts[rel]
        content = new_hash("xxh128")
        content.update(data.encode("utf-8") if isinstance(data, str) else data)
        digest.update(json.dumps(["text", rel, content.hexdigest()]).encode() + b"\n")
    return str(digest.hexdigest())


def journal_header(fingerprint: str, outputs: Iterable[str]) -> str:
    """The journal's first line: the plan's fingerprint and every output it writes."""
    return json.dumps({JOURNAL_HEADER: JOURNAL_VERSION, "plan": fingerprint, "outputs": sorted(outputs)}) + "\n"


def from_journal(lines: list[bytes], journaled: Iterable[str]) -> EarlierRun:
    """The unfinished run a journal's ``lines`` describe; without a first line of ours (an earlier
    reshard's journal) its ``journaled`` (finished) files stand for its outputs."""
    header = _header(lines[0]) if lines else None
    if header is None:
        return EarlierRun(None, frozenset(journaled))
    return EarlierRun(header["plan"], frozenset(header["outputs"]))


def _header(line: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get(JOURNAL_HEADER) != JOURNAL_VERSION:
        return None
    plan, outputs = doc.get("plan"), doc.get("outputs")
    if not isinstance(plan, str) or not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
        return None
    return doc


def from_manifest(doc: Mapping[str, Any]) -> EarlierRun:
    """The finished run a manifest describes (its ``plan``; a manifest of an earlier reshard has none)."""
    outputs = doc.get("outputs")
    listed = [o["path"] for o in outputs if isinstance(o, dict) and "path" in o] if isinstance(outputs, list) else []
    plan = doc.get("plan")
    return EarlierRun(plan if isinstance(plan, str) else None, frozenset(str(p) for p in listed), finished=True)


def refusal(earlier: EarlierRun, fingerprint: str, outputs: Collection[str]) -> str | None:
    """Why a ``--resume`` planned as ``fingerprint``, writing ``outputs`` (relative paths), may not
    continue ``earlier``; None when it may."""
    stale = sorted(earlier.outputs.difference(outputs))
    if not stale and earlier.fingerprint in (None, fingerprint):
        return None
    if stale:
        more = f"s {stale[0]} and {len(stale) - 1} more are" if len(stale) > 1 else f" {stale[0]} is"
        what = f"its output{more} not among this run's"
    else:
        what = "this run writes the same files with other contents: other tensors, dtypes or shapes"
    run = "finished" if earlier.finished else "unfinished"
    return (
        f"{RESUME} refused: the {run} run here was planned with other options ({what}); nothing was changed: "
        "repeat that run's options to continue it, or run without --resume into a new or emptied destination"
    )


__all__ = [
    "JOURNAL_HEADER",
    "JOURNAL_VERSION",
    "EarlierRun",
    "from_journal",
    "from_manifest",
    "journal_header",
    "plan_fingerprint",
    "refusal",
]
