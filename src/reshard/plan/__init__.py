"""Transfer plans: plain data that says where every output byte comes from.

A plan is computed from file *headers* and strategy files only, never from tensor data, so it
can be printed (``reshard plan``), tested without IO, checked before anything is written and
shipped to other machines (Ray). Per output file it lists the tensors, per tensor the boxes to
copy from source tensors; the executor (``reshard.execute.local``) copies each box straight into
place: a box that is one byte run on both sides with a kernel-side copy (or ``pwrite``), a strided
box through a staging buffer (strided numpy copies) and one ``pwrite`` per block.

The planners reproduce MindSpore's choices that decide *which* bytes land *where*: which
parameters an output file holds and in which order (docs/formats.md §3.6, §3.9), which redundant source copy
supplies each element (docs/formats.md §3.5), how ``unified_safetensors`` packs parts (docs/formats.md §4.1), and how a
unified model is split per rank (docs/formats.md §4.3). Layout arithmetic lives in ``reshard.layout``.

The modules, each importing only the ones before it:

* ``model`` — the data model (``Plan``, ``FilePlan``, ``TensorPlan``, ``Copy``; the planning inputs
  ``SourceFile`` / ``SourceTensor``; the ``Role`` of a parameter) and the helpers every planner shares;
* ``agree`` — the strategy and the source headers tell one story (one slice shape per stage, one
  global shape per parameter across stages and for its optimizer states), checked before planning;
* ``transform_reference`` — the reference transform planner (``TransformPlanner``), the one
  decision of what a destination file does with a parameter (``StageCut.role``),
  ``plan_transform_by_rank``;
* ``bulk`` — the machinery every bulk planner shares: per-class tables, templates, lazily built
  tensor lists (``RankTensors``);
* ``transform`` — ``plan_transform``: the reference's plans, built in bulk;
* ``boxes`` — ``plan_boxes``: plans from chunk boxes (``reshard.layout.chunks``), any chunking of
  the sources into any chunking of the outputs, built lazily (``BoxTensors``) like ``bulk``'s;
* ``unify`` — ``plan_unify`` (full tensors in parts); ``split`` — ``plan_split`` (full tensors to ranks);
* ``convert`` — ``plan_convert`` (whole files, other format) and the Hugging Face side of full
  models (shards, ``plan_unify_hf``, ``plan_transform_full``);
* ``validate`` — ``validate_plan``: every output filled exactly once, inside all bounds;
* ``surgery`` — filters and model maps (``reshard.naming``) composed onto plans: ``NameRun``;
* ``cast`` — ``--dtype``: which entries a cast converts, applied to the planning facts
  (``cast_files``) so that every planner's outputs carry the cast dtype.
* ``quantized`` — ``--dequantize`` / ``--quantize``: block-scaled pairs (FP8 blocks, MXFP4) rewritten
  in the planning facts, and the ``QuantizedSource`` facts a plan carries for the executor.

Everything other modules use is importable from ``reshard.plan`` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reshard import lazy

if TYPE_CHECKING:  # where each name lives: a type checker imports them; at run time reshard.lazy reads this
    from reshard.plan.boxes import BoxTensors, OutputFile, Target, plan_boxes
    from reshard.plan.bulk import MATERIALISED_FILES, RankTensors
    from reshard.plan.convert import hf_sharded, plan_convert, plan_hf_shards, plan_transform_full, plan_unify_hf
    from reshard.plan.model import (
        Copy,
        FilePlan,
        FileStats,
        Plan,
        Role,
        SourceFile,
        SourceTensor,
        TensorPlan,
        TextOutput,
    )
    from reshard.plan.split import plan_split
    from reshard.plan.transform import plan_transform
    from reshard.plan.transform_reference import StageCut, TransformPlanner, plan_transform_by_rank
    from reshard.plan.unify import REDUNDANT_STATE_PREFIXES, ChoiceFunc, plan_unify
    from reshard.plan.validate import PlanError, validate_plan

__getattr__, __dir__ = lazy.exports(globals())  # each name's module, from the block above, loads on first use

__all__ = [
    "MATERIALISED_FILES",
    "REDUNDANT_STATE_PREFIXES",
    "BoxTensors",
    "ChoiceFunc",
    "Copy",
    "FilePlan",
    "FileStats",
    "OutputFile",
    "Plan",
    "PlanError",
    "RankTensors",
    "Role",
    "SourceFile",
    "SourceTensor",
    "StageCut",
    "Target",
    "TensorPlan",
    "TextOutput",
    "TransformPlanner",
    "hf_sharded",
    "plan_boxes",
    "plan_convert",
    "plan_hf_shards",
    "plan_split",
    "plan_transform",
    "plan_transform_by_rank",
    "plan_transform_full",
    "plan_unify",
    "plan_unify_hf",
    "validate_plan",
]
