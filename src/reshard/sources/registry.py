"""The source registry: every kind of path reshard reads, and the one answer to "what is this path?".

Each kind (``reshard.sources.kind.Kind``) has a ``name``, what it ``looks_for``, its ``traits``
(what it holds, whether it carries its layouts or has iterations), a cheap ``detect(path)`` and an
``open(path, options, notes)`` returning a typed record of planning facts (``OpenedRanks``,
``OpenedModel``, ``OpenedStrategy``). ``identify(path, accept)`` asks the kinds in the order of
``KINDS`` and returns the first that recognises the path; ``resolve(path, accept, strategy=...,
read=...)`` does the same and then refuses, in one place, what the kind's traits rule out: a
strategy for a kind that carries its layouts (or is one, or is a full model by construction) and an
iteration for a kind without iterations. Every error about what a path is comes from this module:
a path that does not exist, an empty folder, a folder several checkpoints could be meant in, a folder
of DCP data files whose ``.metadata`` never came (an unfinished save), a known kind the operation
does not read (naming what it is and what was wanted), and an unknown path (naming what was looked
for). Errors about a recognised source's content (a truncated file,
an empty rank folder inside a tree) come from its kind's ``open`` and the format readers.

Adding a kind (``checkpoint2.py`` is the latest built-in): write one module with a class that has
``name``, ``looks_for``, ``traits``, ``detect`` and ``open`` and one instance of it, then either
add that instance to ``BUILT_IN`` below (before any kind that would also claim its paths) or call
``register(kind)``, which puts it before the built-ins. An operation names the built-in kinds it
reads; a registered kind is read wherever a built-in kind that holds the same (``Traits.holds``:
a sharded job, a full model) is, so no operation's list changes for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import overload

from reshard import arguments
from reshard.arguments import StrPath
from reshard.errors import UsageError
from reshard.formats import dcp
from reshard.formats.strategy import StrategyFile
from reshard.sources.checkpoint2 import CHECKPOINT2, check_iteration
from reshard.sources.dcp import DCP, is_unfinished_dcp
from reshard.sources.full_model import ENCRYPTED_CKPT, FULL_FILE, HUGGING_FACE, UNIFIED, FullModel
from reshard.sources.kind import SHARDED, AnyKind, Kind, Opened, OpenedModel, OpenedRanks, OpenedStrategy
from reshard.sources.megatron import MEGATRON
from reshard.sources.options import ReadOptions
from reshard.sources.rank_folders import ONE_RANK_FOLDER, RANK_FOLDERS, checkpoints_in
from reshard.sources.strategy import STRATEGY

# Detection order: the first kind whose detect() is true names the path. An index or a unify
# output wins over the files beside it; a strategy .ckpt and an encrypted .ckpt before a plain file.
BUILT_IN: tuple[AnyKind, ...] = (
    MEGATRON,  # before CHECKPOINT2 (the same tracker name) and DCP (its data is a DCP folder)
    CHECKPOINT2,  # before the kinds that would take an iteration folder's files for a full model
    DCP,  # before FULL_FILE and the rank-folder kinds, which would take its .distcp files for checkpoints
    HUGGING_FACE,
    UNIFIED,
    RANK_FOLDERS,
    ONE_RANK_FOLDER,
    STRATEGY,
    ENCRYPTED_CKPT,
    FULL_FILE,
)
KINDS: tuple[AnyKind, ...] = BUILT_IN  # the registered kinds first (``register``), then the built-ins

CHECKPOINTS: tuple[Kind, ...] = (RANK_FOLDERS, ENCRYPTED_CKPT, FULL_FILE)  # what the rank-reading operations take
FULL_MODELS: tuple[Kind, ...] = (UNIFIED, HUGGING_FACE, ENCRYPTED_CKPT, FULL_FILE)  # what split and verify take
SHARDED_JOBS: tuple[Kind, ...] = (RANK_FOLDERS, CHECKPOINT2)  # what unify takes
# Every checkpoint (rank folders, a Checkpoint 2.0, a full model), in the order refusals list them: what
# verify's sides and inspect read (a PyTorch DCP folder too); transform adds one rank's folder as the full
# checkpoint it holds.
CHUNKED: tuple[Kind, ...] = (DCP, MEGATRON)  # the kinds that open as OpenedChunks (a DCP folder's .metadata)
ANY_CHECKPOINT: tuple[Kind, ...] = (*SHARDED_JOBS, *CHUNKED, *FULL_MODELS)

_UNIFY_FIRST = (
    "unify them first (reshard unify SRC UNIFIED --src-strategy S), or reshard them directly (reshard transform)"
)


def register(kind: AnyKind) -> None:
    """Add a kind of source: detected before the built-ins, and read wherever a built-in kind that holds
    the same (``Traits.holds``) is. Registering a kind again (by its name) replaces it; a built-in stays."""
    global KINDS
    KINDS = (kind, *(k for k in KINDS if k in BUILT_IN or k.name != kind.name))


def unregister(kind: AnyKind) -> None:
    """Remove a kind added by ``register`` (the built-ins stay)."""
    global KINDS
    KINDS = tuple(k for k in KINDS if k is not kind or k in BUILT_IN)


def accepts(kind: AnyKind, accept: Sequence[AnyKind]) -> bool:
    """Whether an operation reading ``accept`` reads ``kind``: one of them, or a registered kind that
    holds what one of them holds (a sharded job, a full model)."""
    if kind in accept:
        return True
    return kind not in BUILT_IN and any(k.traits.holds == kind.traits.holds for k in accept)


def _accepted(accept: Sequence[AnyKind]) -> tuple[AnyKind, ...]:
    """``accept`` and the registered kinds it reads, in detection order after the named ones (for "looked for")."""
    return (*accept, *(k for k in KINDS if k not in accept and accepts(k, accept)))


@overload
def identify(path: str, accept: Sequence[Kind]) -> Kind: ...
@overload
def identify(path: str, accept: None = None) -> AnyKind: ...
def identify(path: str, accept: Sequence[AnyKind] | None = None) -> AnyKind:
    """The kind of ``path``, which must be one ``accept`` reads (None: every kind); a ``UsageError``
    naming the path otherwise."""
    return _identify(path, accept)


def _identify(path: str, accept: Sequence[AnyKind] | None) -> AnyKind:
    accept = KINDS if accept is None else _accepted(accept)
    if not os.path.exists(path):
        raise UsageError("no such file or folder", path)
    if os.path.isdir(path) and not _visible(path):
        hidden = sorted(os.listdir(path))
        held = f"holds only {', '.join(hidden[:3])}{' ...' if len(hidden) > 3 else ''}" if hidden else "is empty"
        raise UsageError(f"the folder {held} (looked for {_looked_for(accept)})", path)
    for kind in KINDS:
        if kind is DCP and is_unfinished_dcp(path):  # no kind reads data files without their .metadata
            raise UsageError(dcp.NO_METADATA, path)
        if kind.detect(path):
            if kind in accept:
                return kind
            raise UsageError(_refusal(kind, accept, path), path)
    raise UsageError(_unknown(path, accept), path)


@overload
def resolve(
    path: str,
    accept: Sequence[Kind],
    *,
    strategy: object = None,
    read: ReadOptions | None = None,
    flag: str = "source strategy",
    full_takes_strategy: bool = False,
    subject: str | None = None,
) -> Kind: ...
@overload
def resolve(
    path: str,
    accept: None = None,
    *,
    strategy: object = None,
    read: ReadOptions | None = None,
    flag: str = "source strategy",
    full_takes_strategy: bool = False,
    subject: str | None = None,
) -> AnyKind: ...
def resolve(
    path: str,
    accept: Sequence[AnyKind] | None = None,
    *,
    strategy: object = None,
    read: ReadOptions | None = None,
    flag: str = "source strategy",
    full_takes_strategy: bool = False,
    subject: str | None = None,
) -> AnyKind:
    """``identify``, then every refusal the kind's traits decide, worded in one place.

    Args:
        path: The source.
        accept: The kinds the command reads (None: every kind).
        strategy: The strategy the command was given for the source (None: none).
        read: Its read options: an iteration (``read.iteration``) is refused for a kind without
            iterations.
        flag: How the command names that strategy in its messages ("source strategy", "strategy",
            "--strategy").
        full_takes_strategy: A strategy given with a full model (a Hugging Face model, a unify output)
            is a way to view it (``inspect``, ``show``), not refused.
        subject: How the refusal names the source (None: the kind's name, "a MindFormers Checkpoint 2.0").

    Raises:
        UsageError: The path is missing or not a kind ``accept`` reads; an iteration for a kind
            without iterations; a strategy for a kind that carries its layouts, is a strategy, or
            (unless ``full_takes_strategy``) is a full model by construction.
    """
    kind = _identify(path, accept)
    check_iteration(path, kind, read)
    if strategy is None or (isinstance(strategy, str) and not strategy):
        return kind
    who = subject if subject is not None else kind.name
    traits = kind.traits
    if traits.owns_layouts is not None:
        raise UsageError(f"{who} carries its layouts in {traits.owns_layouts}: give no {flag}", path)
    if traits.holds == STRATEGY.traits.holds:
        raise UsageError(f"{who} is a strategy already: give no {flag}", path)
    if traits.whole and not full_takes_strategy:
        raise UsageError(f"{who} is a full model: give no {flag}", path)
    return kind


@overload
def open_source(
    path: str, accept: Sequence[Kind], options: ReadOptions | None = None, notes: list[str] | None = None
) -> Opened: ...
@overload
def open_source(
    path: str, accept: None = None, options: ReadOptions | None = None, notes: list[str] | None = None
) -> Opened | OpenedStrategy: ...
def open_source(
    path: str,
    accept: Sequence[AnyKind] | None = None,
    options: ReadOptions | None = None,
    notes: list[str] | None = None,
) -> Opened | OpenedStrategy:
    """``identify`` then ``open``: the planning facts of ``path``."""
    return _identify(path, accept).open(path, options, notes if notes is not None else [])


def kind_of(path: str) -> AnyKind | None:
    """The kind of an existing ``path`` without raising (None when no kind recognises it)."""
    if not os.path.exists(path):
        return None
    return next((kind for kind in KINDS if kind.detect(path)), None)


def is_chunked(kind: AnyKind) -> bool:
    """A kind whose sources are chunks of global tensors (a PyTorch DCP folder, a Megatron torch_dist one)."""
    return kind in CHUNKED


def is_sharded(kind: AnyKind) -> bool:
    """A kind whose sources are a job's ranks (rank folders, a Checkpoint 2.0, a registered sharded kind)."""
    return kind.traits.holds == SHARDED


def unified_index(
    path: StrPath, name_map: Mapping[str, str] | None = None, options: ReadOptions | None = None
) -> FullModel:
    """The files of a full model, the name -> file map, and ``hyper_param.safetensors``.

    ``path`` is a unified folder (``part<j>.safetensors`` + ``param_name_map.json``), a Hugging
    Face folder or index file (checked against its shards), one full checkpoint (a file, or a
    folder holding one), or a single-card MindFormers Checkpoint 2.0: its keys, translated back
    through the inverted ``name_map``, are the names.

    Args:
        path: The full model.
        name_map: Output name -> name in the model; its inverse translates a keyed model's names
            (None: names kept).
        options: Read options for the model's files (None: ``ReadOptions()``).

    Returns:
        ``(files, mapping, hyper)``: file name -> ``SourceFile`` header facts, parameter name -> file
        name, and the facts of ``hyper_param.safetensors`` (None when there is none).

    Raises:
        UsageError: The path is missing, empty, or not a full model reshard reads.
        FormatError: A file or index is truncated or corrupted, or an index disagrees with its shards.
        CryptoError: An encrypted ``.ckpt`` does not decrypt with the key given.
        IntegrityError: A ``.ckpt`` crc trailer does not match.
        UnsupportedError: A file holds entries reshard deliberately does not handle.

    Example:
        from reshard import api
        files, mapping, hyper = api.unified_index("demo/full/model.ckpt")
        api.unify("demo/st_8ranks", "demo/strategy_8", "unified")
        files, mapping, hyper = api.unified_index("unified")
    """
    path = arguments.path(path, "path")
    opened = open_source(path, (*FULL_MODELS, CHECKPOINT2), options)
    if isinstance(opened, OpenedRanks):  # a Checkpoint 2.0 of several ranks (one card is a full model)
        way = "unify it first (reshard unify SRC UNIFIED), or reshard it directly (reshard transform)"
        raise UsageError(f"this is {opened.kind} of {len(opened.ranks)} ranks, not a full model: {way}", path)
    assert isinstance(opened, OpenedModel)  # no strategy kind is accepted
    mapping = opened.weight_map
    if opened.keyed:
        inverse = {v: k for k, v in (name_map or {}).items()}
        mapping = {inverse.get(k, k): file for k, file in mapping.items()}
    return opened.files, mapping, opened.hyper


def is_hf_model(path: StrPath) -> bool:
    """A Hugging Face model: an index file, a folder holding one, or a folder (without rank
    folders) holding ``model.safetensors``, the single-shard form."""
    return kind_of(arguments.path(path, "path")) is HUGGING_FACE


def open_strategy(value: str | StrategyFile | None, notes: list[str] | None = None) -> StrategyFile | None:
    """The strategy a path names (a file or a folder of per-stage files); its loading notes (a
    merged file passed over) go to ``notes``. The caller said it is a strategy, so it is not
    detected: a broken strategy file is reported as one."""
    if value is None or isinstance(value, StrategyFile):
        return value
    return STRATEGY.open(value, None, notes if notes is not None else []).strategy


def _visible(folder: str) -> list[str]:
    try:
        return [n for n in os.listdir(folder) if not n.startswith(".")]
    except OSError as exc:
        raise UsageError(f"cannot list the folder: {exc.strerror}", folder) from None


def _wanted(accept: Sequence[AnyKind]) -> str:
    # an encrypted .ckpt is a checkpoint file too: named apart only when plain files are not wanted
    names = [kind.name for kind in accept if not (kind is ENCRYPTED_CKPT and FULL_FILE in accept)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _looked_for(accept: Sequence[AnyKind]) -> str:
    return "; ".join(kind.looks_for for kind in accept)


def _refusal(found: AnyKind, accept: Sequence[AnyKind], path: str) -> str:
    """A known kind an operation does not read: what it is, what was wanted, and the way forward."""
    if found is ONE_RANK_FOLDER:
        parent = os.path.dirname(os.path.normpath(path)) or "."
        return f"this is one rank's folder; give the folder holding the rank_<r> folders ({parent})"
    if found is RANK_FOLDERS:
        text = f"this folder holds rank_<r> folders, not {_wanted(accept)}"
        return f"{text}: {_UNIFY_FIRST}" if UNIFIED in accept else text
    return f"this is {found.name}, not {_wanted(accept)}"


def _unknown(path: str, accept: Sequence[AnyKind]) -> str:
    """No kind recognises ``path``: several checkpoints with nothing saying how they belong
    together, or nothing reshard reads; either way what was looked for is named."""
    looked_for = _looked_for(accept)
    if not os.path.isdir(path):
        return f"not a file reshard reads (looked for {looked_for})"
    found = checkpoints_in(path)
    if len(found) > 1:
        return (
            f"the folder holds {len(found)} checkpoint files and no rank_<r> folders, param_name_map.json or "
            "Hugging Face index; give one of them"
        )
    return f"the folder holds no checkpoint or strategy files (looked for {looked_for})"


__all__ = [
    "ANY_CHECKPOINT",
    "BUILT_IN",
    "CHECKPOINTS",
    "CHUNKED",
    "FULL_MODELS",
    "KINDS",
    "SHARDED_JOBS",
    "accepts",
    "identify",
    "is_chunked",
    "is_hf_model",
    "is_sharded",
    "kind_of",
    "open_source",
    "open_strategy",
    "register",
    "resolve",
    "unified_index",
    "unregister",
]
