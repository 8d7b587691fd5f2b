"""Which tensors a run keeps: ``--include``/``--exclude`` globs and ``--weights-only``.

Filters match the checkpoint's OWN names (the input names, before any rename), because those
are the names ``inspect`` shows and the strategy files use. The rules apply in the order given
and the last rule that matches a name decides; when any ``--include`` is given, a name that
matches no rule is dropped (otherwise kept). ``--weights-only`` drops training state (optimizer
moments, step counters: ``reshard.statenames``' one rule) whatever the globs say. Globs are
``fnmatch`` patterns on the whole name, case-sensitive, and ``*`` also crosses dots.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reshard.errors import UsageError
from reshard.statenames import DEFAULT, StateNames

INCLUDE = "include"
EXCLUDE = "exclude"
WEIGHTS_ONLY = "--weights-only"
HF_WEIGHTS_ONLY = "--hf: weights only, --keep-training-state keeps them"  # the same rule, implied by --hf


@dataclass(frozen=True)
class NameFilter:
    """Ordered ``(INCLUDE|EXCLUDE, glob)`` rules and the weights-only switch."""

    rules: tuple[tuple[str, str], ...] = ()
    weights_only: bool = False
    state: StateNames = DEFAULT
    weights_only_rule: str = WEIGHTS_ONLY  # how the name report words the weights-only rule (not part of what is kept)

    @property
    def active(self) -> bool:
        return bool(self.rules) or self.weights_only

    def dropped_by(self, name: str) -> str | None:
        """The rule that drops ``name`` (``"--exclude 'adam_*'"``), or None when it is kept.

        Example:
            from reshard.naming.filters import EXCLUDE, NameFilter
            f = NameFilter(((EXCLUDE, "adam_*"),))
            assert f.dropped_by("adam_m.w") == "--exclude 'adam_*'" and f.dropped_by("w") is None
        """
        if self.weights_only and self.state.is_state(name):
            return self.weights_only_rule
        decision: tuple[str, str] | None = None
        for kind, glob in self.rules:
            if fnmatch.fnmatchcase(name, glob):
                decision = (kind, glob)
        if decision is None:
            return "matches no --include" if any(k == INCLUDE for k, _ in self.rules) else None
        kind, glob = decision
        return f"--exclude {glob!r}" if kind == EXCLUDE else None

    def split(self, names: Iterable[str]) -> tuple[list[str], list[tuple[str, str]]]:
        """``names`` into the kept ones and the dropped ones with their rule.

        Raises:
            UsageError: An ``--include`` glob matches no name at all, or nothing is left.
        """
        names = list(names)
        for kind, glob in self.rules:
            if kind == INCLUDE and not any(fnmatch.fnmatchcase(n, glob) for n in names):
                raise UsageError(f"--include {glob!r} matches no tensor of the source")
        kept: list[str] = []
        dropped: list[tuple[str, str]] = []
        for name in names:
            rule = self.dropped_by(name)
            if rule is None:
                kept.append(name)
            else:
                dropped.append((name, rule))
        if names and not kept:
            raise UsageError(f"the filters drop all {len(names)} tensors of the source: nothing to write")
        return kept, dropped


def name_filter(
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    weights_only: bool = False,
    order: Sequence[tuple[str, str]] | None = None,
    state: StateNames = DEFAULT,
    weights_only_rule: str = WEIGHTS_ONLY,
) -> NameFilter:
    """A ``NameFilter`` from include and exclude globs (``order``: the rules in the user's order, when known).

    Without ``order``, the includes come first, then the excludes (so an exclude wins over an
    include that also matches).
    """
    rules = tuple(order) if order is not None else (*((INCLUDE, g) for g in include), *((EXCLUDE, g) for g in exclude))
    for kind, glob in rules:
        if kind not in (INCLUDE, EXCLUDE) or not glob:
            raise UsageError(f"bad filter rule {kind} {glob!r}")
    return NameFilter(rules, weights_only, state, weights_only_rule)


__all__ = ["EXCLUDE", "HF_WEIGHTS_ONLY", "INCLUDE", "WEIGHTS_ONLY", "NameFilter", "name_filter"]
