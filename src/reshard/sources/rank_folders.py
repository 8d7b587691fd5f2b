"""Distributed checkpoints as MindSpore saves them: ``rank_<r>`` folders, and one such folder alone.

The file layout itself (folder names, which of several checkpoints a rank uses) is
``reshard.formats.rank_dirs``'s; this module turns it into planning facts and says which file of
each folder was used and which were passed over.
"""

from __future__ import annotations

import os
import re

from reshard import arguments
from reshard.arguments import StrPath
from reshard.errors import UsageError
from reshard.formats import rank_dirs, registry
from reshard.plan import SourceFile
from reshard.sources.files import source_file, source_files
from reshard.sources.kind import FULL, SHARDED, OpenedModel, OpenedRanks, Traits, single_file_model
from reshard.sources.options import ReadOptions, source_choice

_ONE_RANK = re.compile(r"rank_\d+")


def rank_sources(
    model_dir: StrPath,
    fmt: str | None = None,
    rule: str | None = None,
    file_suffix: str | None = None,
    options: ReadOptions | None = None,
    notes: list[str] | None = None,
    listing_order: bool = False,
) -> tuple[str, dict[int, SourceFile]]:
    """The chosen checkpoint of every ``rank_<r>`` folder, as planning facts.

    ``fmt``, ``rule`` and ``file_suffix`` default to ``options``' ``src_format``, ``pick`` and
    ``file_suffix``; a note names the file used, the rule that chose it and the files passed over.
    """
    model_dir = arguments.path(model_dir, "model_dir")
    # ``auto`` is a ReadOptions (CLI) choice; an explicit file_suffix argument is MindSpore's literal suffix
    auto = file_suffix is None and options is not None and options.file_suffix == rank_dirs.AUTO_SUFFIX
    fmt, rule, file_suffix = source_choice(fmt, rule, file_suffix, options)
    check_rank_folders(model_dir)
    if auto:
        file_suffix = _auto_suffix(model_dir, notes)
    fmt, chosen = rank_dirs.collect_rank_files(model_dir, fmt, rule, file_suffix, listing_order)
    rule = rule or rank_dirs.default_rule(fmt)
    if notes is not None:
        for picked in chosen.values():
            if picked.ignored:
                ignored = ", ".join(os.path.basename(p) for p in picked.ignored)
                why = f"the one ending in {file_suffix}" if file_suffix else rank_dirs.RULE_TEXT[rule]
                notes.append(f"rank {picked.rank}: using {os.path.basename(picked.path)} ({why}), ignoring {ignored}")
    return fmt, source_files({r: p.path for r, p in chosen.items()}, options)


def _auto_suffix(model_dir: str, notes: list[str] | None) -> str:
    """``--file-suffix auto``: the newest step every rank folder holds, said in a note."""
    suffix, text = rank_dirs.newest_common_suffix(model_dir)
    if notes is not None:
        notes.append(text)
    return suffix


def check_rank_folders(model_dir: str) -> None:
    """An empty ``rank_<r>`` folder inside a rank-folder tree is said plainly (it is no rank's checkpoint)."""
    if not os.path.isdir(model_dir):
        return
    for rank, folder in rank_dirs.rank_dirs(model_dir).items():
        if not any(rank_dirs.files_in(folder, f) for f in registry.names()):
            raise UsageError(f"rank {rank}'s folder is empty (no {registry.listed()} file)", folder)


def rank_subfolders(path: str) -> list[str]:
    """The ``rank*`` sub-folders of ``path`` (MindSpore's converters glob ``rank*``), sorted by name."""
    return sorted(d for d in os.listdir(path) if d.startswith("rank") and os.path.isdir(os.path.join(path, d)))


def chosen_names(folder: str, fmt: str, choose: ReadOptions, notes: list[str] | None) -> list[str]:
    """Every file name of ``folder``, or only the one ``choose`` picks (``--file-suffix``/``--pick``)."""
    if not (choose.file_suffix or choose.pick):
        return sorted(os.listdir(folder))
    _, rule, suffix = source_choice(None, None, None, choose)
    if suffix == rank_dirs.AUTO_SUFFIX:  # across the rank* folders beside this one (convert)
        parent = os.path.dirname(os.path.abspath(folder))
        siblings = {i: os.path.join(parent, name) for i, name in enumerate(rank_subfolders(parent))}
        suffix, text = rank_dirs.newest_common_suffix(parent, siblings)
        if notes is not None and text not in notes:
            notes.append(text)
    files = rank_dirs.files_in(folder, fmt)
    if not files and not suffix:
        return []
    chosen = rank_dirs.choose_file(folder, files, fmt, rule or "name", suffix)
    ignored = [os.path.basename(p) for p in files if p != chosen]
    if ignored and notes is not None:
        why = f"the one ending in {suffix}" if suffix else rank_dirs.RULE_TEXT[rule or "name"]
        notes.append(
            f"{os.path.basename(folder)}: using {os.path.basename(chosen)} ({why}), ignoring {', '.join(ignored)}"
        )
    return [os.path.basename(chosen)]


def checkpoints_in(folder: str) -> list[str]:
    """The checkpoint files (``.ckpt``, ``.safetensors``, any registered format's) directly in ``folder``."""
    return [f for fmt in registry.names() for f in rank_dirs.files_in(folder, fmt)]


class RankFolders:
    """A folder of ``rank_<r>`` folders (``rank*`` for the converters), each holding checkpoints."""

    name = "rank folders"
    looks_for = "a folder of rank_<r> folders holding .ckpt or .safetensors files"
    traits = Traits(SHARDED)

    def detect(self, path: str) -> bool:
        return os.path.isdir(path) and bool(rank_subfolders(path))

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedRanks:
        fmt, ranks = rank_sources(path, options=options, notes=notes)
        return OpenedRanks(self.name, path, fmt, ranks)


class OneRankFolder:
    """One ``rank_<r>`` folder given alone: its one checkpoint is a full checkpoint (rank 0)."""

    name = "one rank's folder"
    looks_for = "a rank_<r> folder holding .ckpt or .safetensors files"
    traits = Traits(FULL)  # read as the full checkpoint it holds (rank 0 of a one-rank job)

    def detect(self, path: str) -> bool:
        name = os.path.basename(os.path.normpath(path))
        return (
            os.path.isdir(path)
            and _ONE_RANK.fullmatch(name) is not None
            and not rank_subfolders(path)
            and bool(checkpoints_in(path))
        )

    def single(self, path: str) -> str | None:
        """The folder's checkpoint when it holds exactly one."""
        found = checkpoints_in(path)
        return found[0] if len(found) == 1 else None

    def refusal(self, path: str) -> str:
        """Why it is not the rank-folder tree an operation with a strategy reads."""
        parent = os.path.dirname(os.path.normpath(path)) or "."
        return f"this is one rank's folder; give the folder holding the rank_<r> folders ({parent})"

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedModel:
        single = self.single(path)
        if single is None:
            raise UsageError(self.refusal(path), path)
        fmt = rank_dirs.detect_format(single)
        return single_file_model(self.name, path, fmt, source_file(single, 0, options))


RANK_FOLDERS = RankFolders()
ONE_RANK_FOLDER = OneRankFolder()

__all__ = [
    "ONE_RANK_FOLDER",
    "RANK_FOLDERS",
    "check_rank_folders",
    "checkpoints_in",
    "chosen_names",
    "rank_sources",
    "rank_subfolders",
]
