"""The name report: what a run did to every name, so nothing is ever dropped or renamed silently.

Filters (``--include``/``--exclude``/``--weights-only``) and maps (``--rename`` rules, presets) each
say what they did; the CLI prints the counts and lists on stderr (``--json``: in the output) and
``--strict`` refuses a run that left names unmatched. ``check_family`` is the guard for a map
written for another model family: when most names are unmatched it is almost certainly the wrong
map, and writing a checkpoint with a handful of renamed tensors would only hide that.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from reshard.errors import UsageError

# A map that leaves more than this share of the input names unmatched is for another model family.
FOREIGN_FAMILY_THRESHOLD = 0.5


@dataclass(frozen=True)
class NameReport:
    """Per name: renamed (old, new), surgery (op, inputs, outputs), dropped (name, rule), unmatched."""

    renamed: tuple[tuple[str, str], ...] = ()
    surgery: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = ()
    dropped: tuple[tuple[str, str], ...] = ()
    unmatched: tuple[str, ...] = ()
    mapped: bool = False  # a map (rules, preset) was applied: "unmatched" means something

    def with_dropped(self, dropped: tuple[tuple[str, str], ...]) -> NameReport:
        return replace(self, dropped=dropped)

    @property
    def empty(self) -> bool:
        return not (self.renamed or self.surgery or self.dropped or self.unmatched)

    def to_json(self) -> dict[str, object]:
        return {
            "renamed": [{"from": a, "to": b} for a, b in self.renamed],
            "surgery": [{"op": op, "from": list(a), "to": list(b)} for op, a, b in self.surgery],
            "dropped": [{"name": n, "rule": r} for n, r in self.dropped],
            "unmatched": list(self.unmatched),
            "counts": self.counts(),
        }

    def counts(self) -> dict[str, int]:
        return {
            "renamed": len(self.renamed),
            "surgery": len(self.surgery),
            "dropped": len(self.dropped),
            "unmatched": len(self.unmatched) if self.mapped else 0,
        }

    def lines(self) -> list[str]:
        """The report as text lines: a counts line, then one line per name."""
        c = self.counts()
        out = [
            f"names: {c['renamed']} renamed, {c['surgery']} split/joined/stacked, {c['dropped']} dropped by a filter"
            + (f", {c['unmatched']} unmatched (kept as they are)" if self.mapped else "")
        ]
        out += [f"  renamed   {a} -> {b}" for a, b in self.renamed]
        out += [f"  {op:<9} {', '.join(a)} -> {', '.join(b)}" for op, a, b in self.surgery]
        out += [f"  dropped   {n}  ({r})" for n, r in self.dropped]
        if self.mapped:
            out += [f"  unmatched {n}" for n in self.unmatched]
        return out


def check_strict(report: NameReport, what: str) -> None:
    """``--strict``: refuse a run whose map left any name unmatched.

    Raises:
        UsageError: Some names were unmatched (the first few are named).
    """
    if report.mapped and report.unmatched:
        first = ", ".join(report.unmatched[:3]) + (", ..." if len(report.unmatched) > 3 else "")
        raise UsageError(f"--strict: {len(report.unmatched)} name(s) match no rule of {what}: {first}")


def check_family(report: NameReport, total: int, what: str, threshold: float = FOREIGN_FAMILY_THRESHOLD) -> None:
    """Refuse a map that leaves most of ``total`` input names unmatched (a map for another model family).

    Args:
        report: The map's report.
        total: How many input names the map was applied to.
        what: The map's name in the message (``"preset qwen3"``).
        threshold: The largest share of unmatched names accepted.

    Raises:
        UsageError: More than ``threshold`` of the names were unmatched.

    Example:
        from reshard.naming.report import NameReport, check_family
        check_family(NameReport(unmatched=("a",), mapped=True), 4, "rules.yaml")
    """
    if total and len(report.unmatched) > threshold * total:
        raise UsageError(
            f"{what} matches only {total - len(report.unmatched)} of {total} tensor names: "
            "is it for another model family?"
        )


__all__ = ["FOREIGN_FAMILY_THRESHOLD", "NameReport", "check_family", "check_strict"]
