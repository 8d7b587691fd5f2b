"""What a run does to names: one options object every writing operation takes (``names=``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard.naming.filters import NameFilter
from reshard.naming.ops import ModelMap


@dataclass(frozen=True)
class NameOptions:
    """Filters, a model map and how strictly unmatched names are treated.

    ``filter``: which input tensors are kept (``--include``/``--exclude``/``--weights-only``).
    ``model_map``: renames and tensor surgery (``--rename RULES``, a preset), applied to the kept
    tensors; None: names kept. ``strict``: refuse a run whose map leaves a name unmatched.
    ``guard_family``: refuse a map that leaves most names unmatched (a preset for another model
    family; ``reshard.naming.report.FOREIGN_FAMILY_THRESHOLD``).
    """

    filter: NameFilter = field(default_factory=NameFilter)
    model_map: ModelMap | None = None
    strict: bool = False
    guard_family: bool = False

    @property
    def active(self) -> bool:
        return self.filter.active or self.model_map is not None


__all__ = ["NameOptions"]
