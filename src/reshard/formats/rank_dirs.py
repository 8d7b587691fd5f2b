"""The one place that knows how distributed checkpoints sit on disk.

MindSpore keeps one folder per rank, ``model_dir/rank_<r>/<name>.{ckpt,safetensors}``, and the
converters write ``dst/rank_<r>/<prefix><r>.<fmt>``. A rank folder often holds several checkpoints
(one per saved step), and MindSpore's converters choose among them by three different rules
(docs/formats.md §3.9, §4.0, §6.1): the lexicographically last name (``.ckpt`` transform), the largest "last two
numbers in the name" (safetensors flows), or the newest mtime (MindFormers by-rank). We implement
each rule by name so the drop-in functions pick the same file, and we always *report* the files we
ignored, because silently picking a stale checkpoint is a classic way to ship the wrong weights.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from reshard.errors import UsageError
from reshard.formats import registry

# The built-in formats' names, for callers that list them at import time; everything here asks
# ``formats.registry`` itself, so a format added by ``registry.register`` is read in rank folders too.
FORMATS = registry.names()
_RANK_DIR = re.compile(r"rank_(\d+)$")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class RankFile:
    """The checkpoint chosen for one rank, and the candidates that were passed over."""

    rank: int
    path: str
    ignored: tuple[str, ...] = field(default=())


def rank_dirs(model_dir: str, listing_order: bool = False) -> dict[int, str]:
    """``{rank: folder}`` for every ``rank_<digits>`` sub-folder, sorted by rank.

    ``listing_order=True`` keeps the directory's listing order instead: MindSpore's
    ``unified_safetensors`` globs without sorting, and that order decides its part packing and
    the order of ``param_name_map.json``; the drop-in functions reproduce it.
    """
    if not os.path.isdir(model_dir):
        raise UsageError("not a folder", model_dir)
    found: dict[int, str] = {}
    for name in os.listdir(model_dir):
        match = _RANK_DIR.search(name)
        path = os.path.join(model_dir, name)
        if match and name.startswith("rank_") and os.path.isdir(path):
            found[int(match.group(1))] = path
    return found if listing_order else dict(sorted(found.items()))


def detect_format(path: str) -> str:
    """The format of a checkpoint file from its name (``ckpt``, ``safetensors``, or a registered one)."""
    return registry.detect(path)


def files_in(folder: str, fmt: str, suffix: str | None = None) -> list[str]:
    """Checkpoint files of one format directly in ``folder`` (sorted by name)."""
    pattern = f"*{suffix or ''}{registry.suffix(fmt)}"
    return sorted(p for p in glob.glob(os.path.join(glob.escape(folder), pattern)) if os.path.isfile(p))


def _last_two_numbers(path: str) -> tuple[int, ...]:
    return tuple(int(x) for x in _DIGITS.findall(path)[-2:])


PICK_RULES: dict[str, Callable[[list[str]], str]] = {
    # transform_checkpoints on .ckpt: glob + sort, last one
    "name": lambda files: sorted(files)[-1],
    # safetensors flows (unified_safetensors, transform on safetensors): largest last two numbers
    "numbers": lambda files: max(files, key=_last_two_numbers),
    # MindFormers by-rank transform: newest modification time
    "mtime": lambda files: max(files, key=lambda p: (os.path.getmtime(p), p)),
}


# The CLI's ``--pick`` names for the rules a user may choose (the default stays MindSpore's rule).
PICKS = {"last-name": "name", "newest": "mtime"}

RULE_TEXT = {  # for the note that says which file was used
    "name": "the last name, MindSpore's rule for .ckpt",
    "numbers": "the largest epoch/step numbers, MindSpore's rule for .safetensors",
    "mtime": "the newest, by --pick newest",
}


def default_rule(fmt: str) -> str:
    """MindSpore's rule for choosing among a rank folder's files of ``fmt``: the last name for ``.ckpt``
    (its ``transform_checkpoints`` sorts), the largest epoch/step numbers for every other format."""
    return "name" if fmt == "ckpt" else "numbers"


def _suffix_matches(files: list[str], fmt: str, suffix: str) -> list[str]:
    """MindSpore's ``file_suffix`` matching (docs/formats.md §4.0): exact tail, shortest basename wins."""
    tail = suffix if suffix.startswith(("_", "-")) else None
    ext = registry.suffix(fmt)
    candidates = []
    for path in files:
        base = os.path.basename(path)
        if tail is not None:
            ok = base.endswith(f"{tail}{ext}") and not base.endswith(f"rank{tail}{ext}")
        else:
            ok = any(base.endswith(f"{sep}{suffix}{ext}") for sep in ("_", "-"))
        if ok:
            candidates.append(path)
    return candidates


def pick_file(folder: str, fmt: str, rule: str = "name", file_suffix: str | None = None) -> RankFile | None:
    """Choose the checkpoint of ``fmt`` in a rank folder; None when the folder has none."""
    files = files_in(folder, fmt)
    if not files and not file_suffix:
        return None
    chosen = choose_file(folder, files, fmt, rule, file_suffix)
    rank = int(_RANK_DIR.search(os.path.basename(folder.rstrip("/"))).group(1))  # type: ignore[union-attr]
    return RankFile(rank, chosen, tuple(p for p in files if p != chosen))


def choose_file(folder: str, files: list[str], fmt: str, rule: str = "name", file_suffix: str | None = None) -> str:
    """One of ``files`` (checkpoints of ``fmt`` in ``folder``): the one ending in ``file_suffix``, else by ``rule``."""
    if not file_suffix:
        return PICK_RULES[rule](files)
    matching = _suffix_matches(files, fmt, file_suffix)
    if not matching:
        raise UsageError(f"no *{file_suffix}{registry.suffix(fmt)} file", folder)
    shortest = min(len(os.path.basename(p)) for p in matching)
    best = [p for p in matching if len(os.path.basename(p)) == shortest]
    if len(best) > 1:
        raise UsageError(f"several files match suffix {file_suffix!r}: {', '.join(best)}", folder)
    return best[0]


def collect_rank_files(
    model_dir: str,
    fmt: str | None = None,
    rule: str | None = None,
    file_suffix: str | None = None,
    listing_order: bool = False,
) -> tuple[str, dict[int, RankFile]]:
    """The format and the chosen file of every rank folder of a distributed checkpoint.

    ``fmt=None`` detects it: a folder tree holding both formats is refused (as MindSpore does).
    ``rule=None`` uses MindSpore's rule for that format (``name`` for ckpt, ``numbers`` for
    safetensors).
    """
    dirs = rank_dirs(model_dir, listing_order)
    if not dirs:
        raise UsageError("no rank_<r> sub-folders", model_dir)
    if fmt is None:
        present = {f for f in registry.names() for d in dirs.values() if files_in(d, f)}
        if len(present) > 1:
            first, second = [registry.suffix(f) for f in registry.names() if f in present][:2]
            raise UsageError(f"rank folders hold both {first} and {second} files; choose one", model_dir)
        if not present:
            raise UsageError(f"rank folders hold no {registry.listed()} files", model_dir)
        fmt = present.pop()
    rule = rule or default_rule(fmt)
    chosen = {}
    for rank, folder in dirs.items():
        picked = pick_file(folder, fmt, rule, file_suffix)
        if picked is not None:
            chosen[rank] = picked
    return fmt, chosen


# ``--file-suffix auto`` (docs/formats.md §11.2): MindFormers names checkpoints
# ``{prefix}_rank_{r}[_{task}]-{epoch}_{step}``; MindSpore's ModelCheckpoint ``{prefix}-{epoch}_{step}``.
AUTO_SUFFIX = "auto"
_MINDFORMERS_NAME = re.compile(r".+_rank_\d+(?:_(\d+))?-(\d+)_(\d+)")
_EPOCH_STEP_NAME = re.compile(r".+-(\d+)_(\d+)")


def epoch_step_suffix(path: str) -> tuple[str, int, int] | None:
    """``(suffix, epoch, step)`` of a checkpoint named ``...-{epoch}_{step}.<fmt>`` (None: another name).

    The suffix is what ``--file-suffix`` matches: ``-{epoch}_{step}``, or ``_{task}-{epoch}_{step}`` for
    MindFormers' names that carry a task id after the rank.
    """
    stem = os.path.splitext(os.path.basename(path))[0]
    match = _MINDFORMERS_NAME.fullmatch(stem)
    if match:
        task, epoch, step = match.groups()
        return (f"_{task}-{epoch}_{step}" if task else f"-{epoch}_{step}"), int(epoch), int(step)
    match = _EPOCH_STEP_NAME.fullmatch(stem)
    if match:
        epoch, step = match.groups()
        return f"-{epoch}_{step}", int(epoch), int(step)
    return None


def newest_common_suffix(model_dir: str, folders: dict[int, str] | None = None) -> tuple[str, str]:
    """``--file-suffix auto``: the newest ``-{epoch}_{step}`` suffix every rank folder has a checkpoint of.

    Newest means the largest (epoch, step); a tie between task ids goes to the newest file of the
    first rank. A step saved by only some ranks (a save cut short) is passed over and named in the
    returned description, which says what was chosen and why.
    """
    folders = folders if folders is not None else rank_dirs(model_dir)
    if not folders:
        raise UsageError("--file-suffix auto: no rank_<r> sub-folders", model_dir)
    per_rank: dict[int, dict[str, tuple[int, int, float]]] = {}
    for rank, folder in folders.items():
        found: dict[str, tuple[int, int, float]] = {}
        for path in (p for fmt in registry.names() for p in files_in(folder, fmt)):
            parsed = epoch_step_suffix(path)
            if parsed is not None:
                suffix, epoch, step = parsed
                found[suffix] = max(found.get(suffix, (epoch, step, 0.0)), (epoch, step, os.path.getmtime(path)))
        per_rank[rank] = found
    first = per_rank[min(per_rank)]
    common = set(first).intersection(*per_rank.values())
    if not common:
        raise UsageError(
            "--file-suffix auto: no -<epoch>_<step> checkpoint is present in every rank folder "
            "(give --file-suffix SUFFIX)",
            model_dir,
        )
    chosen = max(common, key=lambda s: first[s])
    epoch, step, _ = first[chosen]
    text = (
        f"--file-suffix auto: using {chosen} (epoch {epoch}, step {step}: the newest present in all "
        f"{len(folders)} rank folders)"
    )
    newer = {s: found[s][:2] for found in per_rank.values() for s in found if found[s][:2] > (epoch, step)}
    if newer:
        latest = max(newer, key=lambda s: newer[s])
        missing = ", ".join(str(r) for r, found in per_rank.items() if latest not in found)
        text += f"; {latest} is newer but missing in rank {missing}"
    return chosen, text


def rank_dir(dst_dir: str, rank: int) -> str:
    return os.path.join(dst_dir, f"rank_{rank}")


# What an output name prefix may not hold: each lets the name leave its rank_<r> folder (or the
# destination), or is not a file name at all. MindSpore's converters let "/x" write "/x0.ckpt".
UNSAFE_PREFIX_PARTS = ("/", "\\", "..", "\x00")


def check_prefix(prefix: str) -> str:
    """``prefix`` when every output named with it stays inside its ``rank_<r>`` folder; else ``UsageError``."""
    for part in UNSAFE_PREFIX_PARTS:
        if part in prefix or (part == "/" and os.sep in prefix):
            shown = {"\x00": "a NUL byte", "/": "a path separator", "\\": "a path separator"}.get(part, repr(part))
            raise UsageError(
                f"output prefix {prefix!r} contains {shown}: a prefix names files inside each rank_<r> "
                "folder and may not lead out of it"
            )
    return prefix


def rank_output(dst_dir: str, rank: int, prefix: str, fmt: str, part: int | None = None) -> str:
    """``dst/rank_<r>/<prefix><r>[_part<stage>].<fmt>`` as MindSpore's converters name outputs."""
    check_prefix(prefix)
    tail = f"_part{part}" if part is not None else ""
    return os.path.join(rank_dir(dst_dir, rank), f"{prefix}{rank}{tail}{registry.suffix(fmt)}")


__all__ = [
    "AUTO_SUFFIX",
    "FORMATS",
    "PICKS",
    "PICK_RULES",
    "RULE_TEXT",
    "UNSAFE_PREFIX_PARTS",
    "RankFile",
    "check_prefix",
    "choose_file",
    "collect_rank_files",
    "default_rule",
    "detect_format",
    "epoch_step_suffix",
    "files_in",
    "newest_common_suffix",
    "pick_file",
    "rank_dir",
    "rank_dirs",
    "rank_output",
]
