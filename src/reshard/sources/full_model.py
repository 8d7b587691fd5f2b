"""Full (unsharded) checkpoints as source kinds: one file, an encrypted ``.ckpt``, unify's output, a
Hugging Face model.

All of them are read as one model: its files by name, which file holds each tensor (the weight
map) and unify's ``hyper_param.safetensors`` when there is one. A single checkpoint is also rank
0 of a one-rank job, so the operations that read rank folders take it as well.
"""

from __future__ import annotations

import os

from reshard import arguments
from reshard.arguments import StrPath
from reshard.errors import FormatError, UsageError
from reshard.formats import hf_index, megatron, rank_dirs, registry
from reshard.formats.ckpt import probe_ckpt
from reshard.plan import SourceFile
from reshard.sources.files import source_file
from reshard.sources.kind import FULL, OpenedModel, Traits, single_file_model
from reshard.sources.options import ReadOptions
from reshard.sources.rank_folders import checkpoints_in, rank_subfolders
from reshard.sources.strategy import NAME_MAP, is_strategy_file

CONFIG_NAME = "config.json"  # a Hugging Face model's config (reshard writes one beside a DCP output of FP8 pairs)

HYPER_NAME = "hyper_param.safetensors"  # unify's file of the parameters outside the strategy
FullModel = tuple[dict[str, SourceFile], dict[str, str], SourceFile | None]  # files, weight map, hyper


def full_model_file(path: StrPath) -> str | None:
    """The one checkpoint file ``path`` stands for: the file itself, or the only ``.ckpt`` /
    ``.safetensors`` file of a folder without ``rank_<r>`` folders (``full/model.ckpt``'s folder);
    None otherwise."""
    path = arguments.path(path, "path")
    if os.path.isfile(path):
        return path if registry.format_of(path) is not None else None
    if not os.path.isdir(path) or rank_subfolders(path):
        return None
    found = [f for f in checkpoints_in(path) if not is_strategy_file(f)]
    return found[0] if len(found) == 1 else None


def is_encrypted(path: str) -> bool:
    """A ``.ckpt`` whose first bytes are an encrypted header (MindSpore's AES-GCM or SM4-CBC)."""
    if not path.endswith(".ckpt"):
        return False
    try:
        return probe_ckpt(path).cipher is not None
    except OSError:
        return False  # the reader reports it


def model_folder(path: StrPath) -> str:
    """The folder a full-model input stands for (an index file stands for its folder)."""
    path = arguments.path(path, "path")
    index = hf_index.is_index_file(path) or os.path.basename(path) == NAME_MAP
    return os.path.dirname(os.path.abspath(path)) if index else path


def config_path(path: str) -> str:
    """Where the ``config.json`` of an input is (it may not exist): in its folder (a file's: beside it), or,
    for a Megatron-LM run folder, in the checkpoint its tracker names (where reshard writes one)."""
    folder = model_folder(path)
    folder = folder if os.path.isdir(folder) else os.path.dirname(os.path.abspath(folder))
    beside = os.path.join(folder, CONFIG_NAME)
    if os.path.isfile(beside) or not megatron.iteration_folders(folder):
        return beside
    try:
        return os.path.join(megatron.resolve_iteration(folder, None), CONFIG_NAME)
    except (UsageError, FormatError):
        return beside  # reading the source says what is wrong with it


def _single(path: str, options: ReadOptions | None, name: str) -> OpenedModel:
    """A full checkpoint: rank 0 of a one-rank job, and a full model of one file."""
    single = full_model_file(path)
    if single is None:  # detect said otherwise: the registry asked the wrong kind
        raise UsageError(f"not {name}", path)
    return single_file_model(name, path, rank_dirs.detect_format(single), source_file(single, 0, options))


class FullFile:
    """One ``.ckpt`` / ``.safetensors`` file, or a folder holding just one (and no rank folders)."""

    name = "a checkpoint file"
    looks_for = "a .ckpt or .safetensors file, or a folder holding one"
    traits = Traits(FULL)  # may also be rank 0 of a one-rank job: a strategy can describe it

    def detect(self, path: str) -> bool:
        return full_model_file(path) is not None

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedModel:
        return _single(path, options, self.name)


class EncryptedCkpt:
    """An encrypted ``.ckpt`` (or a folder holding one): read with ``ReadOptions.dec_key``."""

    name = "an encrypted .ckpt file"
    looks_for = "an encrypted .ckpt file"
    traits = Traits(FULL, encrypted=True)

    def detect(self, path: str) -> bool:
        single = full_model_file(path)
        return single is not None and is_encrypted(single)

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedModel:
        return _single(path, options, self.name)


class Unified:
    """unify's output: ``part<j>.safetensors`` + ``param_name_map.json`` (the folder or that file),
    or one ``.safetensors`` file beside ``hyper_param.safetensors``."""

    name = "a unified model"
    looks_for = "a unify output (part*.safetensors + param_name_map.json)"
    traits = Traits(FULL, whole=True)

    def detect(self, path: str) -> bool:
        if os.path.isfile(path):
            return os.path.basename(path) == NAME_MAP
        if not os.path.isdir(path) or rank_subfolders(path):
            return False
        names = _safetensors(path)
        models = [n for n in names if n != HYPER_NAME]
        return bool(names) and (os.path.isfile(os.path.join(path, NAME_MAP)) or (len(models) == 1 < len(names)))

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedModel:
        folder = model_folder(path)
        names = _safetensors(folder)
        models = [n for n in names if n != HYPER_NAME] or names
        index_path = os.path.join(folder, NAME_MAP)
        if len(names) == 1 or (len(models) == 1 and not os.path.isfile(index_path)):
            return _with_hyper(folder, models[0], options, self.name)
        files = {n: source_file(os.path.join(folder, n), 0, options) for n in names}
        hyper = files.pop(HYPER_NAME, None)
        weight_map = hf_index.read_weight_map(index_path, strict=False)
        return OpenedModel(self.name, path, "safetensors", files, weight_map, hyper=hyper)


class HuggingFace:
    """A Hugging Face model: ``model.safetensors.index.json`` (or its folder) and its shards, or a
    folder (without rank folders) holding ``model.safetensors``, the single-shard form."""

    name = "a Hugging Face model"
    looks_for = "a Hugging Face model (model.safetensors.index.json, or model.safetensors)"
    traits = Traits(FULL, whole=True)

    def detect(self, path: str) -> bool:
        if hf_index.find_index(path) is not None:
            return True
        return (
            os.path.isdir(path)
            and os.path.isfile(os.path.join(path, hf_index.SINGLE_NAME))
            and not rank_subfolders(path)
        )

    def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedModel:
        index = hf_index.find_index(path)
        if index is None:
            return _with_hyper(path, hf_index.SINGLE_NAME, options, self.name)
        files, mapping, hyper = hf_model(index, options)
        return OpenedModel(self.name, path, "safetensors", files, mapping, hyper=hyper)


def _safetensors(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


def _with_hyper(folder: str, only: str, options: ReadOptions | None, kind: str) -> OpenedModel:
    """One model file, and ``hyper_param.safetensors`` beside it when there is one."""
    facts = source_file(os.path.join(folder, only), 0, options)
    hyper_path = os.path.join(folder, HYPER_NAME)
    hyper = source_file(hyper_path, 0, options) if only != HYPER_NAME and os.path.isfile(hyper_path) else None
    weight_map = dict.fromkeys(facts.tensors, only)
    return OpenedModel(kind, folder, "safetensors", {only: facts}, weight_map, hyper=hyper, keyed=True)


def hf_model(index_path: StrPath, options: ReadOptions | None = None) -> FullModel:
    """A Hugging Face index's shards (by file name), its weight map, and a ``hyper_param.safetensors``
    beside it that the index does not name (``unify --hf`` writes one).

    Refused, each with one line naming the file: a shard the index names but the folder lacks, a
    name the weight map assigns to a shard that does not hold it, a tensor held by two shards.
    """
    index_path = arguments.path(index_path, "index_path")
    mapping = hf_index.read_weight_map(index_path)
    folder = os.path.dirname(os.path.abspath(index_path))
    index_name = os.path.basename(index_path)
    files: dict[str, SourceFile] = {}
    for shard in sorted(set(mapping.values())):  # model-00001-of-... first
        path = os.path.join(folder, shard)
        if not shard.endswith(".safetensors"):
            raise FormatError(f"the weight_map names {shard!r}, which is not a .safetensors shard", index_path)
        if not os.path.isfile(path):
            raise UsageError(f"shard named by {index_name} is missing", path)
        files[shard] = source_file(path, 0, options)
    holder: dict[str, str] = {}
    for shard, sf in files.items():
        for name in sf.tensors:
            if name in holder:
                raise FormatError(f"tensor {name!r} is in two shards: {holder[name]} and {shard}", index_path)
            holder[name] = shard
    for name, shard in mapping.items():
        if name not in files[shard].tensors:
            raise FormatError(f"{index_name} lists {name!r} in this shard, but it is not there", files[shard].path)
    hyper_path = os.path.join(folder, HYPER_NAME)
    hyper = source_file(hyper_path, 0, options) if HYPER_NAME not in files and os.path.isfile(hyper_path) else None
    return files, mapping, hyper


FULL_FILE = FullFile()
ENCRYPTED_CKPT = EncryptedCkpt()
UNIFIED = Unified()
HUGGING_FACE = HuggingFace()

__all__ = [
    "CONFIG_NAME",
    "ENCRYPTED_CKPT",
    "FULL_FILE",
    "HUGGING_FACE",
    "HYPER_NAME",
    "UNIFIED",
    "FullModel",
    "config_path",
    "full_model_file",
    "hf_model",
    "is_encrypted",
    "model_folder",
]
