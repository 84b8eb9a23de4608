"""What every model family's ``config.json`` parser shares: the error type and a lookup that
treats an explicit JSON ``null`` like a missing key (HF writes both)."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A checkpoint's config.json cannot describe a model we implement."""


def get_or_default(d: dict, key: str, default: Any) -> Any:
    value = d.get(key, default)
    return default if value is None else value
