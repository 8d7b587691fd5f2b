"""``split``: a unified (full) model sliced into ``rank_<r>/net.<fmt>`` for a destination strategy.

The source is unify's output, a Hugging Face model or one full checkpoint: a full model, so the
tensor pipeline maps it before planning and the strategy names the mapped tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from reshard import arguments
from reshard.arguments import StrPath
from reshard.errors import UsageError
from reshard.execute.options import RunOptions, WriteOptions
from reshard.formats.strategy import StrategyFile
from reshard.ops import dcp_output
from reshard.ops.arguments import check_option_types, strategy_argument
from reshard.ops.options import WRITES, Destination, OutputSpec, TensorOptions, output_format
from reshard.ops.run import Report, Target, folder_superseded, run_plan
from reshard.ops.tensors import Inputs, TensorPipeline
from reshard.plan import Plan, plan_split, plan_transform_full
from reshard.plan.dcp import StrategyBoxes
from reshard.sources import HYPER_NAME, model_folder, open_strategy, unified_index

FORMATS = WRITES["split"]  # the first is its default


def split(
    unified_dir: StrPath,
    dst_strategy: StrPath | StrategyFile,
    dst_dir: StrPath,
    *,
    ranks: Sequence[int] | None = None,
    output: OutputSpec | None = None,
    name_map: Mapping[str, str] | None = None,
    destination: Destination | None = None,
    tensors: TensorOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
) -> Report:
    """Slice a unified (full) model into ``dst_dir/rank_<r>/net.<fmt>`` for a target strategy.

    ``unified_dir`` may also be a Hugging Face sharded model (its folder or its index file) or one
    full checkpoint.

    Args:
        unified_dir: The unified folder (``part<j>.safetensors`` + ``param_name_map.json``), a
            Hugging Face model or a full checkpoint; every path argument is a ``str`` or an ``os.PathLike``.
        dst_strategy: The destination strategy, a path or a ``StrategyFile``.
        dst_dir: The output folder.
        ranks: Only these destination ranks, an iterable of ints >= 0 (None: all).
        output: ``OutputSpec(format="safetensors")`` (the default, None), ``format="ckpt"``, ``format="dcp"``
            or ``"torch_dist"`` (a PyTorch DCP / Megatron-core checkpoint of the strategy's distinct rank boxes,
            ``.metadata`` last).
        name_map: Output name -> name in the unified model (None: names kept).
        destination: How ``dst_dir`` is treated (``Destination``: overwrite, resume, dry run, manifest).
        tensors: Filters, maps (applied to the full model first, so the strategy names its outputs),
            dequantize/quantize and casts (``TensorOptions``). None: every tensor as it is.
        write: What the outputs' bytes hold (``WriteOptions``: crc trailer, encryption, checksum).
        run: How the run executes (``RunOptions``; a ``RayOptions`` runs on Ray). None: ``RunOptions()``.

    Returns:
        A ``Report``: the plan, notes, the files a resumed run kept and the name report.

    Raises:
        UsageError: ``unified_dir`` is not a full model, an output format split does not write, write
            options that do not fit the outputs, or a refused destination (see ``check_destination``).
        LayoutError: The strategy does not fit the tensors.
        FormatError: A strategy or source file that cannot be read, is truncated or is not what it claims.
        IntegrityError: A full ``.ckpt`` source's crc trailer does not match.
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        api.unify("demo/st_8ranks", "demo/strategy_8", "unified")
        api.split("unified", "demo/strategy_4", "st_4ranks", ranks=[0, 1])
    """
    unified_dir, dst_dir = arguments.path(unified_dir, "unified_dir"), arguments.path(dst_dir, "dst_dir")
    strategy, ranks = strategy_argument(dst_strategy, "dst_strategy"), arguments.ranks(ranks)
    check_option_types(output=output, destination=destination, tensors=tensors, write=write, run=run)
    fmt = output_format(output, FORMATS, "split") or FORMATS[0]
    dcp_output.check_iteration(output, "--output-format")
    dcp_output.check_options(output, write, strategy_given=True)
    pipeline = TensorPipeline(tensors, unified_dir)
    files, mapping, hyper = unified_index(unified_dir, name_map)
    notes: list[str] = []
    sf = open_strategy(strategy, notes)
    if sf is None:
        raise UsageError("split needs the destination strategy")
    inputs = pipeline.apply(Inputs(files, mapping, hyper), notes, whole=True)
    paired = pipeline.paired_destination(sf, inputs, notes) or sf  # each FP8 scale laid out as its weight
    where = destination or Destination()
    if fmt in dcp_output.FORMATS:
        plan = _dcp_plan(inputs, paired, dst_dir, ranks, notes)
        plan = pipeline.finish(plan, notes)
        config = pipeline.dcp_config(plan, notes)
        plan = dcp_output.as_dcp(plan, dst_dir, StrategyBoxes(paired), notes, output, config=config)
        stale = dcp_output.superseded(dcp_output.save_folder(dst_dir, output), where.overwrite, where.resume)
        target = Target(dst_dir, [model_folder(unified_dir)], superseded=stale)
        return run_plan(plan, target, where, None, write, run, notes, pipeline.report)
    plan = plan_split(inputs.files, inputs.mapping or {}, inputs.hyper, paired, dst_dir, fmt, ranks, name_map)
    plan = pipeline.finish(inputs.resolve(plan), notes)
    target = Target(dst_dir, [model_folder(unified_dir)], superseded=folder_superseded(dst_dir, sf, where))
    return run_plan(plan, target, where, None, write, run, notes, pipeline.report)


def _dcp_plan(
    inputs: Inputs, strategy: StrategyFile, dst_dir: str, ranks: Sequence[int] | None, notes: list[str]
) -> Plan:
    """The full tensors ``--output-format dcp`` cuts into the strategy's rank boxes (the hyper-parameters too)."""
    if ranks is not None:
        raise UsageError("a DCP checkpoint is written whole: give no destination ranks")
    files, mapping = dict(inputs.files), dict(inputs.mapping or {})
    if inputs.hyper is not None:
        files[HYPER_NAME] = inputs.hyper
        mapping.update({n: HYPER_NAME for n in inputs.hyper.tensors if n not in mapping})
    return inputs.resolve(plan_transform_full(files, mapping, None, dst_dir, "", "safetensors"))


__all__ = ["FORMATS", "split"]
