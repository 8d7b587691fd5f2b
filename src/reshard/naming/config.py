"""Model config values for a map's sizes: a Hugging Face ``config.json`` or a MindFormers YAML.

A ``ModelMap``'s sizes are expressions over config names (``num_attention_heads``, ``head_dim``).
Hugging Face keeps them at the top of ``config.json``; MindFormers nests them (``model:
model_config: ...`` in its YAML files). ``load_config`` reads either and flattens nested mappings
into one name -> value table; a name found at several depths keeps its shallowest value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from reshard.errors import UsageError


def flatten(doc: Mapping[str, object]) -> dict[str, object]:
    """``doc``'s keys, nested mappings' keys after them (breadth first; the shallowest value of a name wins).

    Example:
        from reshard.naming.config import flatten
        assert flatten({"a": 1, "model": {"model_config": {"a": 2, "b": 3}}}) == {"a": 1, "b": 3}
    """
    out: dict[str, object] = {}
    level: list[Mapping[str, object]] = [doc]
    while level:
        deeper: list[Mapping[str, object]] = []
        for mapping in level:
            for key, value in mapping.items():
                if isinstance(value, Mapping):
                    deeper.append(value)
                else:
                    out.setdefault(str(key), value)
        level = deeper
    return out


def load_config(path: str) -> dict[str, object]:
    """The config values of a ``config.json`` (JSON) or a MindFormers YAML file, flattened.

    Args:
        path: The file.

    Returns:
        Name -> value (``flatten``).

    Raises:
        UsageError: The file cannot be read, does not parse, or is not a mapping.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read model config: {e.strerror if isinstance(e, OSError) else e}", path) from None
    try:
        doc = json.loads(text) if path.endswith(".json") else _yaml(text)
    except ValueError as e:
        raise UsageError(f"model config does not parse: {str(e).splitlines()[0]}", path) from None
    if not isinstance(doc, Mapping):
        raise UsageError("a model config is a mapping of names to values", path)
    return flatten(doc)


def _yaml(text: str) -> object:
    import yaml  # type: ignore[import-untyped,unused-ignore]

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e) or type(e).__name__) from None


__all__ = ["flatten", "load_config"]
