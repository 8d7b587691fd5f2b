"""``convert``: ``.ckpt`` <-> ``.safetensors`` file by file, one full ``.ckpt`` into Hugging Face shards.

Each input file becomes one output file of the other format under the same rank folder name (or
beside it, as MindSpore does, without a destination). A ``.ckpt`` to ``.ckpt`` conversion is a
re-encryption (``ops.recrypt``). Without a destination the run's own check replaces the folder
check: rank folders are refused (the outputs would go into the source), existing outputs too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from reshard import arguments
from reshard.arguments import StrPath
from reshard.errors import UsageError
from reshard.execute.options import RunOptions, WriteOptions
from reshard.ops import dcp_output
from reshard.ops.arguments import check_option_types
from reshard.ops.options import WRITES, Destination, OutputSpec, TensorOptions, shard_bytes
from reshard.ops.pairs import convert_targets, holds_only_ckpt
from reshard.ops.recrypt import recrypt
from reshard.ops.run import Report, Target, run_plan
from reshard.ops.tensors import Inputs, TensorPipeline, full_tensors, training_state_note
from reshard.plan import Plan, hf_sharded, plan_convert
from reshard.sources import (
    CHECKPOINT2,
    ENCRYPTED_CKPT,
    FULL_FILE,
    HUGGING_FACE,
    ONE_RANK_FOLDER,
    RANK_FOLDERS,
    Kind,
    ReadOptions,
    full_model_file,
    identify,
    indexed,
    is_chunked,
    kind_of,
)
from reshard.text import OVERWRITE

FORMATS = WRITES["convert"]


def convert(
    src: StrPath,
    dst: StrPath | None,
    to: str | OutputSpec,
    *,
    name_map: Mapping[str, str] | None = None,
    file_regex: str | None = None,
    destination: Destination | None = None,
    tensors: TensorOptions | None = None,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
) -> Report:
    """Convert ``.ckpt`` <-> ``.safetensors`` for one file or a folder of ``rank*`` folders.

    Without ``dst`` one file's output goes next to it (as MindSpore does) and the manifest into its
    folder; existing outputs are then refused unless overwriting or resuming. ``rank*`` folders
    without ``dst`` are refused unless ``Destination(manifest=False)`` (the MindSpore drop-in: outputs
    beside the inputs, no manifest). ``OutputSpec(format="hf")`` converts one full ``.ckpt`` file
    into Hugging Face shards (at most ``max_shard_size``, default ``5GB``) + its index. ``.ckpt``
    sources with ``to="ckpt"`` are re-written into ``dst`` (``recrypt``): encrypted with
    ``write.enc_key`` (after decrypting with ``read.dec_key`` when given) or decrypted (only
    ``read.dec_key``). A folder without ``rank*`` folders holding one checkpoint file stands for it.

    Args:
        src: A checkpoint file, or a folder of ``rank*`` folders (``src`` and ``dst``: a ``str`` or an
            ``os.PathLike`` such as ``pathlib.Path``).
        dst: The output folder (None: next to the inputs; rank folders only without a manifest).
        to: The output format, ``"ckpt"``, ``"safetensors"``, ``"dcp"`` or ``"torch_dist"`` (one full checkpoint
            as a one-file PyTorch DCP or Megatron-core checkpoint), or an ``OutputSpec`` (``format="hf"`` with
            its ``max_shard_size``).
        name_map: Output name -> source name (None: names kept).
        file_regex: Only inputs whose name matches (None: all).
        destination: How ``dst`` is treated (``Destination``: overwrite, resume, dry run, manifest).
        tensors: Filters and maps (tensor surgery only for one full file), dequantize/quantize and
            casts (``TensorOptions``). None: every tensor as it is.
        read: How sources are read (``ReadOptions``: decryption, crc checking, which file of a rank
            folder). None: ``ReadOptions()``.
        write: What the outputs' bytes hold (``WriteOptions``: crc trailer, encryption, checksum).
        run: How the run executes (``RunOptions``; a ``RayOptions`` runs on Ray). None: ``RunOptions()``.

    Returns:
        A ``Report``: the plan, notes (files passed over), the files a resumed run kept and the
        name report.

    Raises:
        UsageError: A bad ``to``, a missing source, an existing output or refused destination, a
            ``.ckpt`` to ``.ckpt`` conversion without a key, Hugging Face output from anything but
            one ``.ckpt`` file, a checkpoint only ``transform`` reads (a Checkpoint 2.0, a PyTorch DCP
            or Megatron torch_dist folder, a sharded Hugging Face model: the line names the transform),
            or write options that do not fit the outputs (see ``execute``).
        FormatError: A source file that cannot be read, is truncated or is not what it claims.
        CryptoError: An encrypted source does not decrypt with ``read.dec_key`` / ``dec_mode``.
        IntegrityError: A source's crc trailer does not match its content.
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        api.convert("demo/ckpt_8ranks", "st_8ranks", "safetensors")
        api.convert("demo/full/model.ckpt", "hf", api.OutputSpec(format="hf", max_shard_size="4MB"))
    """
    src, dst = arguments.path(src, "src"), arguments.optional_path(dst, "dst")
    check_option_types(destination=destination, tensors=tensors, read=read, write=write, run=run)
    if not isinstance(to, (str, OutputSpec)):
        raise UsageError(
            f"to must be ckpt, safetensors, dcp or torch_dist, or an OutputSpec, not {arguments.describe(to)}"
        )
    output = to if isinstance(to, OutputSpec) else OutputSpec(format=to)
    if output.format not in FORMATS:
        raise UsageError(f"--to must be ckpt, safetensors, dcp or torch_dist, not {output.format!r}")
    dcp_output.check_iteration(output, "--to")
    _refuse_transform_sources(src, output.format)
    if output.format in dcp_output.FORMATS:
        return _to_dcp(src, dst, output, name_map, file_regex, destination, tensors, read, write, run)
    fmt = "safetensors" if output.format == "hf" else output.format
    shard_size = shard_bytes(output)
    where = destination or Destination()
    pipeline = TensorPipeline(tensors, src)
    given, src = src, _convert_source(src)
    if fmt == "ckpt" and holds_only_ckpt(src):
        _check_recrypt(src, pipeline)
        return recrypt(src, dst, file_regex=file_regex, destination=where, read=read, write=write, run=run)
    if shard_size is not None and not os.path.isfile(src):
        raise UsageError("Hugging Face output converts one full .ckpt file to safetensors", src)
    notes: list[str] = []
    pairs = convert_targets(src, dst, fmt, file_regex, read, notes)
    inputs = pipeline.apply(Inputs(dict(enumerate(indexed([(i, 0) for i, _ in pairs], read)))), notes)
    plan = plan_convert([(inputs.files[k], o, fmt) for k, (_, o) in enumerate(pairs)], name_map)
    plan = pipeline.after(plan, inputs, full=len(pairs) == 1)  # another family is refused first
    pipeline.check_config(full_tensors(inputs.files.values()))
    if shard_size is not None:
        out_dir = os.path.dirname(pairs[0][1]) if pairs else (dst or os.path.dirname(os.path.abspath(src)))
        plan = hf_sharded(plan, out_dir, shard_size)
        training_state_note(plan, notes)
    plan = pipeline.finish(plan, notes, read)
    root = dst if dst else (src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src)))
    target = Target(root, [given, src]) if dst else Target(root, check=lambda: _check_beside(src, plan, where))
    return run_plan(plan, target, where, read, write, run, notes, pipeline.report)


def _to_dcp(
    src: str,
    dst: str | None,
    output: OutputSpec,
    name_map: Mapping[str, str] | None,
    file_regex: str | None,
    destination: Destination | None,
    tensors: TensorOptions | None,
    read: ReadOptions | None,
    write: WriteOptions | None,
    run: RunOptions | None,
) -> Report:
    """A full model (one checkpoint file) as a one-file PyTorch DCP checkpoint in ``dst``: transform's DCP output."""
    from reshard.ops.transform import transform

    dcp_output.check_options(output, write)
    if dst is None:
        raise UsageError("a DCP checkpoint is a folder: give a destination")
    if name_map is not None or file_regex is not None:
        raise UsageError(
            f"convert --to {output.format} converts one full checkpoint: no name map or file pattern (use --rename)"
        )
    full = _convert_source(src)
    if os.path.isdir(full) and kind_of(full) is RANK_FOLDERS:
        raise UsageError(
            f"convert --to {output.format} converts one full checkpoint file; for rank folders use "
            f"reshard transform SRC DST --src-strategy S --output-format {output.format}",
            src,
        )
    spec = OutputSpec(format=output.format, dcp_ranks=output.dcp_ranks or 1, iteration=output.iteration)
    return transform(full, dst, output=spec, destination=destination, tensors=tensors, read=read, write=write, run=run)


def _check_recrypt(src: str, pipeline: TensorPipeline) -> None:
    """A ``.ckpt`` to ``.ckpt`` conversion re-writes bytes (keys only): no filter, map or cast."""
    if pipeline.naming.active or pipeline.dequantizer is not None:
        raise UsageError("filters and renames apply when converting between ckpt and safetensors, not to recrypt")
    if pipeline.cast is not None:
        raise UsageError(
            "convert --to ckpt re-writes .ckpt files byte for byte (keys only); to cast a .ckpt use "
            "transform with no strategies (one full file) or convert it to safetensors",
            src,
        )


def _check_beside(src: str, plan: Plan, where: Destination) -> None:
    """Without a destination: never into rank folders (with a manifest), never over an existing output."""
    if os.path.isdir(src) and where.manifest:
        raise UsageError(
            "give a destination folder: without one the outputs would go into the source's rank folders "
            "(only the MindSpore drop-in, which keeps no manifest, writes there, as MindSpore does)",
            src,
        )
    if not (where.overwrite or where.resume):
        existing = [p for p in [f.path for f in plan.files] + [t.path for t in plan.texts] if os.path.exists(p)]
        if existing:
            raise UsageError(f"output exists (use {OVERWRITE} to replace it)", existing[0])


def _refuse_transform_sources(src: str, fmt: str | None) -> None:
    """A checkpoint ``transform`` reads and convert does not (a Checkpoint 2.0, a PyTorch DCP or Megatron
    torch_dist folder, a sharded Hugging Face model): one line naming the transform that writes ``fmt``."""
    kind = kind_of(src) if os.path.exists(src) else None
    if kind is CHECKPOINT2:
        raise UsageError(
            "this is a MindFormers Checkpoint 2.0 (safetensors, resharded by its metadata.json): get .ckpt or "
            "rank folders with reshard transform SRC DST --output-format ckpt [--dst-strategy S]",
            src,
        )
    if kind is None or not (is_chunked(kind) or (kind is HUGGING_FACE and full_model_file(src) is None)):
        return
    flags = "--hf [--max-shard-size SIZE]" if fmt == "hf" else f"--output-format {fmt}"
    raise UsageError(f"this is {kind.name}, which convert does not read: use reshard transform SRC DST {flags}", src)


def _convert_source(src: str) -> str:
    """What convert reads: ``rank*`` folders as they are, or the one checkpoint file ``src`` stands
    for (a file, or a folder holding just one: a ``rank_<r>`` folder, ``model.safetensors``'s folder)."""
    single = full_model_file(src)
    kinds: tuple[Kind, ...] = (RANK_FOLDERS, ENCRYPTED_CKPT, FULL_FILE)
    if single is not None and os.path.isdir(src):
        kinds += (ONE_RANK_FOLDER, HUGGING_FACE)
    kind = identify(src, kinds)
    return src if kind is RANK_FOLDERS else single or src


__all__ = ["FORMATS", "convert"]
