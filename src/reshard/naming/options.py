"""What a run does to names: one options object every writing operation takes (``names=``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reshard.naming.filters import NameFilter

if TYPE_CHECKING:  # a run without a map never loads the surgery vocabulary
    from reshard.naming.ops import ModelMap


@dataclass(frozen=True)
class NameOptions:
    """Filters, a model map and how strictly unmatched names are treated.

    ``filter``: which input tensors are kept (``--include``/``--exclude``/``--weights-only``).
    ``model_map``: renames and tensor surgery (``--rename RULES``, a preset), applied to the kept
    tensors; None: names kept. ``strict``: refuse a run whose map leaves a name unmatched.
    ``guard_family``: refuse a map that leaves most names unmatched (a preset for another model
    family; ``reshard.naming.report.FOREIGN_FAMILY_THRESHOLD``). ``config``: a model config
    (``--hf-config``, read with ``load_config``; ``config_path`` names it in messages) the full
    tensors must agree with (``reshard.naming.shapes``); None: the map's config, if any.
    """

    filter: NameFilter = field(default_factory=NameFilter)
    model_map: ModelMap | None = None
    strict: bool = False
    guard_family: bool = False
    config: Mapping[str, object] | None = None
    config_path: str | None = None

    @property
    def active(self) -> bool:
        return self.filter.active or self.model_map is not None

    def fingerprint(self) -> str:
        """Text that is the same exactly when the options keep and name the same tensors (a cache key's part)."""
        state = self.filter.state
        doc = {
            "rules": [list(rule) for rule in self.filter.rules],
            "weights_only": self.filter.weights_only,
            "state": [sorted(state.prefixes), sorted(state.names)] if self.filter.weights_only else None,
            "map": _map_text(self.model_map),
            "config": json.dumps(dict(self.model_map.config), sort_keys=True, default=str) if self.model_map else None,
            "strict": self.strict,
            "guard_family": self.guard_family,
        }
        return json.dumps(doc, sort_keys=True)


def _map_text(model_map: ModelMap | None) -> str | None:
    if model_map is None:
        return None
    return repr(model_map.ops) if model_map.then is None else repr([m.ops for m in model_map.stages()])


__all__ = ["NameOptions"]
