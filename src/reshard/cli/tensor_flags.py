"""The names and dtypes flag group → ``TensorOptions``: filters, renames, presets, casts, (de)quantizing.

Every writing command takes the same group (``verify`` and ``auto-transform`` a part of it), and an
operation applies it in one fixed order (filters, then dequantize/quantize, then casts, then model
maps; ``reshard.ops.options``). Everything a flag names is read here, before any checkpoint, so
a bad rules file or config is one line and nothing written (``docs/naming.md``, ``docs/presets.md``).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reshard.cli.flags import flag, section
from reshard.errors import UsageError
from reshard.naming.filters import EXCLUDE, HF_WEIGHTS_ONLY, INCLUDE, WEIGHTS_ONLY, NameFilter, name_filter
from reshard.naming.options import NameOptions
from reshard.ops.options import TensorOptions

if TYPE_CHECKING:
    from reshard.naming import ModelMap
    from reshard.plan.quantized import Precision

NAME_REPORT_LINES = 10  # names listed per kind on stderr; --names-report FILE keeps every one


class LazyChoices:
    """An argparse ``choices`` whose values are computed on first use: the presets and the name worlds
    live with the tensor-surgery modules, which only a run with ``--preset`` (or ``--help``) loads.
    Its flag needs a ``metavar``: every parse formats the usage line (intermixed parsing does), and
    a flag without one would list its choices there."""

    def __init__(self, values: Callable[[], Iterable[str]]) -> None:
        self._compute = values

    @functools.cached_property
    def _values(self) -> tuple[str, ...]:
        return tuple(self._compute())

    def __contains__(self, value: object) -> bool:
        return value in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def _preset_names() -> Iterable[str]:
    from reshard.naming.presets import PRESETS

    return PRESETS


def _name_worlds() -> Iterable[str]:
    from reshard.naming.megatron import WORLDS

    return WORLDS


class _NameRule(argparse.Action):
    """``--include``/``--exclude``: each appends ``(kind, glob)`` to ``name_rules``, keeping the user's order."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: str | None = None) -> None:
        kind = INCLUDE if self.dest == "include" else EXCLUDE
        namespace.name_rules = [*(namespace.name_rules or []), (kind, values)]


@dataclass(frozen=True)
class Tensors:
    """What the group gave: the operation's ``TensorOptions``, and what the command does after the run
    with it (the name report's file, the ``--hf-config`` bytes to copy beside Hugging Face shards)."""

    options: TensorOptions
    names_report: str | None = None
    hf_config: bytes | None = None
    block_size: str | None = None

    @property
    def dequantize(self) -> str | None:
        return self.options.precision.dequantize if self.options.precision is not None else None

    @property
    def quantize(self) -> str | None:
        return self.options.precision.quantize if self.options.precision is not None else None


class TensorFlags:
    """``--include``/``--exclude``/``--weights-only`` (``filters``, their verbs per command), ``--rename``,
    ``--strict``, ``--names-report``, ``--preset``, ``--hf-config`` (``names``), and ``--dtype``,
    ``--dtype-all``, ``--dequantize``, ``--quantize``, ``--block-size`` (``dtypes``)."""

    def __init__(self, names: bool = True, dtypes: bool = True, verb: str = "keep only", drop: str = "drop") -> None:
        self.names, self.dtypes, self.verb, self.drop = names, dtypes, verb, drop

    def add(self, parser: argparse.ArgumentParser) -> None:
        g = section(parser, "names and dtypes")
        self._add_filters(g)
        if self.names:
            self._add_maps(g)
        if self.dtypes:
            self._add_dtypes(g)
        parser.set_defaults(name_rules=None)

    def _add_filters(self, g: Any) -> None:
        verb, drop = self.verb, self.drop
        flag(
            g,
            "--include",
            action=_NameRule,
            metavar="GLOB",
            help=f"{verb} tensors whose source name matches (repeatable; with --exclude the last matching rule wins)",
        )
        flag(
            g,
            "--exclude",
            action=_NameRule,
            metavar="GLOB",
            help=f"{drop} tensors whose source name matches (repeatable)",
        )
        flag(
            g,
            "--weights-only",
            action="store_true",
            help=f"{drop} training state: optimizer moments (adam_m., adam_v., accu_grads., ...), global_step, "
            "learning_rate, ...",
        )

    def _add_maps(self, g: Any) -> None:
        flag(
            g,
            "--rename",
            metavar="RULES",
            help="JSON or YAML file of ordered {match, replace} regex rules (first match wins)",
        )
        flag(g, "--strict", action="store_true", help="with --rename: fail if a name matches no rule")
        flag(
            g,
            "--names-report",
            metavar="FILE",
            help=f"write the whole name report (every renamed, dropped and unmatched name) as JSON to FILE; "
            f"stderr lists the first {NAME_REPORT_LINES} of each kind",
        )
        flag(
            g,
            "--preset",
            choices=LazyChoices(_preset_names),
            metavar="NAME",
            help="MindFormers <-> Hugging Face names of a model family, with its tensor surgery (docs/presets.md); "
            "with --hf: to Hugging Face names; one of %(choices)s",
        )
        flag(
            g,
            "--hf-config",
            metavar="FILE",
            help="the model's Hugging Face config.json: gives --preset the sizes its surgery needs; with --hf it "
            "is copied into the output",
        )
        for side, what in (("src", "the input's"), ("dst", "the output's")):
            flag(
                g,
                f"--{side}-names",
                choices=LazyChoices(_name_worlds),
                metavar="WORLD",
                help=f"with --preset: whose names {what} tensors have, megatron (Megatron-core), hf or mindformers "
                "(docs/megatron-names.md)",
            )

    def _add_dtypes(self, g: Any) -> None:
        flag(
            g,
            "--dtype",
            metavar="DTYPE",
            help="cast floating model weights to bf16, fp16 or fp32 while copying (integers, bools, strings "
            "and 0-d scalars are never cast; an overflow to inf is an error and writes nothing)",
        )
        flag(
            g,
            "--dtype-all",
            legacy=["--dtype_all"],
            dest="dtype_all",
            action="store_true",
            help="with --dtype: cast optimizer states too (default: they keep their dtype)",
        )
        flag(
            g,
            "--dequantize",
            metavar="DTYPE",
            help="turn every FP8 block pair (X + X_scale_inv) and MXFP4 pair (P_blocks + P_scales) into one "
            "bf16, fp16 or fp32 tensor while copying; the scales are consumed",
        )
        flag(
            g,
            "--block-size",
            legacy=["--block_size"],
            dest="block_size",
            metavar="ROWSxCOLS",
            help="the FP8 block size, e.g. 128x128: with --dequantize (default: config.json's "
            "quantization_config.weight_block_size), with --quantize (default: 128x128)",
        )
        flag(
            g,
            "--quantize",
            metavar="SCHEME",
            help="fp8-block: write 2-D float *.weight tensors as F8_E4M3 plus an F32 *.weight_scale_inv per "
            "block (DeepSeek's rule; embeddings, norms, lm_head and routers stay as they are)",
        )
        flag(
            g,
            "--quantize-include",
            dest="quantize_include",
            metavar="GLOB",
            action="append",
            help="with --quantize: also quantize the 2-D float tensors these names match (repeatable)",
        )
        flag(
            g,
            "--quantize-exclude",
            dest="quantize_exclude",
            metavar="GLOB",
            action="append",
            help="with --quantize: never quantize the tensors these names match (repeatable)",
        )

    # ---------------------------------------------------------------------------- building

    def name_filter(self, args: argparse.Namespace, hf: bool = False, keep_state: bool = False) -> NameFilter | None:
        """The filter the flags give (None: every tensor). ``--hf`` means weights only (what every
        Hugging Face loader expects) unless ``--keep-training-state`` says otherwise."""
        rules = args.name_rules or []
        if keep_state and not hf:
            raise UsageError(
                "--keep-training-state applies to --hf output (other outputs keep everything unless --weights-only)"
            )
        if keep_state and args.weights_only:
            raise UsageError("--keep-training-state and --weights-only contradict each other: give one")
        asked = args.weights_only
        weights_only = asked or (hf and not keep_state)
        rule = WEIGHTS_ONLY if asked else HF_WEIGHTS_ONLY
        if not (rules or weights_only):
            return None
        return name_filter(order=rules, weights_only=weights_only, weights_only_rule=rule)

    def build(
        self,
        args: argparse.Namespace,
        inputs: Sequence[str],
        overwrite: bool,
        hf: bool = False,
        keep_state: bool = False,
    ) -> Tensors:
        """The group's ``Tensors``; ``inputs``: every path the command reads (a name report may not
        replace one), ``hf``/``keep_state``: ``--hf`` and ``--keep-training-state``."""
        report = args.names_report if self.names else None
        if report:
            check_side_file(report, "name report (--names-report)", inputs, overwrite)
        config_bytes, config_values, model_map = self._maps(args, hf)
        strict = bool(self.names and args.strict)
        if strict and model_map is None:
            raise UsageError("--strict needs --rename or --preset (it refuses names no rule matches)")
        keep = self.name_filter(args, hf, keep_state)
        names = None
        if keep is not None or model_map is not None or config_values is not None:
            guard = self.names and args.preset is not None
            path = args.hf_config if self.names else None
            names = NameOptions(keep or name_filter(), model_map, strict, guard, config_values, path)
        if not self.dtypes:
            return Tensors(TensorOptions(names=names), report, config_bytes)
        options = TensorOptions(names, args.dtype, args.dtype_all, self._precision(args, config_bytes))
        return Tensors(options, report, config_bytes, args.block_size)

    def _maps(self, args: argparse.Namespace, hf: bool) -> tuple[bytes | None, Any, ModelMap | None]:
        """``--hf-config``'s bytes and values, and the model map of ``--rename RULES`` or ``--preset NAME``."""
        if not self.names:
            return None, None, None
        rename, name, path = args.rename, args.preset, args.hf_config
        if rename and name:
            raise UsageError("--rename and --preset are two name maps: give one")
        if path and not (hf or name):
            raise UsageError("--hf-config needs --hf (to copy it) or --preset (to take sizes from it)")
        raw, config = None, None
        if path:
            from reshard.naming.config import load_config

            config = load_config(path)  # names what is wrong with the file, before any checkpoint is read
            try:
                with open(path, "rb") as f:
                    raw = f.read()  # copied beside the shards as it is
            except OSError as e:
                raise UsageError(f"--hf-config {path}: {e.strerror or e}") from None
            if hf and not _is_json_object(raw):
                raise UsageError(
                    f"--hf-config {path}: with --hf it is copied as config.json, so it must be a JSON object"
                )
        preset = _preset(args, name, config, hf) if name is not None else None
        if name is None and (args.src_names or args.dst_names):
            raise UsageError("--src-names and --dst-names need --preset (the model family whose names they are)")
        if rename:
            from reshard.naming.rules import load_rules

            return raw, config, load_rules(rename)
        return raw, config, preset

    def _precision(self, args: argparse.Namespace, config_bytes: bytes | None) -> Precision | None:
        block = args.block_size
        include, exclude = tuple(args.quantize_include or ()), tuple(args.quantize_exclude or ())
        quantize = args.quantize
        if args.dequantize is None and quantize is None and block is None and not include + exclude:
            return None
        from reshard.plan.quantized import Precision, parse_block

        size = (
            parse_block(block) if block is not None else None if quantize is not None else _config_block(config_bytes)
        )
        return Precision(args.dequantize, size, quantize, include, exclude)


def _preset(args: argparse.Namespace, name: str, config: Any, hf: bool) -> ModelMap:
    """``--preset NAME``'s map: MindFormers <-> Hugging Face, or between the ``--src-names``/``--dst-names`` worlds."""
    from reshard.naming import presets
    from reshard.naming.megatron import HF, MEGATRON, MINDFORMERS, world_map

    src, dst = args.src_names, args.dst_names
    if hf and dst not in (None, HF):
        raise UsageError(f"--hf writes Hugging Face names: --dst-names {dst} contradicts it")
    if src is None and dst is None:
        return presets.preset_map(name, None, config, presets.TO_HF if hf else None)
    dst = dst or (HF if hf or src in (MEGATRON, MINDFORMERS) else MINDFORMERS)
    src = src or (HF if dst in (MEGATRON, MINDFORMERS) else MINDFORMERS)
    if MEGATRON in (src, dst):
        return world_map(name, src, dst, config)
    if src == dst:
        raise UsageError(f"--src-names and --dst-names are both {src}: nothing to map")
    return presets.preset_map(name, None, config, presets.TO_HF if dst == HF else presets.FROM_HF)


def _config_block(raw: bytes | None) -> tuple[int, int] | None:
    """``--hf-config``'s FP8 block size, when it has one (else the source's config.json decides)."""
    from reshard.plan.quantized import block_from_config

    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return block_from_config(doc) if isinstance(doc, dict) else None


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


def input_paths(*paths: str | None) -> list[str]:
    """The paths a command reads (checkpoints and strategies; MindFormers' ``None`` is none)."""
    from reshard.cli.values import no_path

    return [p for p in paths if isinstance(p, str) and no_path(p) is not None]


def check_side_file(path: str, what: str, inputs: Sequence[str], overwrite: bool, make_folder: bool = False) -> None:
    """A file the command writes beside its output, checked before the first byte (reshard.destination)."""
    from reshard import destination

    destination.check_output_file(path, list(inputs), overwrite, what, make_folder)


__all__ = ["NAME_REPORT_LINES", "LazyChoices", "TensorFlags", "Tensors", "check_side_file", "input_paths"]
