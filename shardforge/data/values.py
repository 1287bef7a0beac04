"""How a decoded JSON value is named in an error message: its JSON type, or itself, shortened."""

from __future__ import annotations

import json
from typing import Any


def kind(value: Any) -> str:
    """The JSON name of a value's type, for messages written in the user's terms."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def show(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)[:60]
