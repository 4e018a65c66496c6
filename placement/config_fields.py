"""Typed reading of a Hugging Face `config.json` with one-line errors naming the file and the field.

`ConfigFields` wraps the parsed JSON object of one config (or of a nested section such as a
multimodal config's `text_config`) and hands out typed values. Every failure is an `InputError`
whose message reads `config.json: field 'text_config.num_experts' must be an integer, got "eight"`.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.errors import InputError

_MISSING: Any = object()


def _show(value: Any) -> str:
    text = (
        json.dumps(value) if not isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    )
    return text if len(text) <= 60 else text[:57] + "..."


class ConfigFields:
    """Typed accessors over one JSON object of a config file.

    `label` is the file name used in messages; `prefix` is the dotted path of this object inside
    the file ("" at the top, "text_config." inside the language-model section).
    """

    def __init__(self, data: dict[str, Any], *, label: str, prefix: str = "") -> None:
        self.data = data
        self.label = label
        self.prefix = prefix

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def error(self, name: str, expected: str, value: Any = _MISSING) -> InputError:
        where = f"{self.label}: field '{self.prefix}{name}'"
        if value is _MISSING:
            return InputError(f"{where} is missing ({expected})")
        return InputError(f"{where} must be {expected}, got {_show(value)}")

    def _raw(self, names: tuple[str, ...], default: Any) -> tuple[str, Any]:
        for name in names:
            if self.data.get(name) is not None:
                return name, self.data[name]
        if default is _MISSING:
            raise self.error(names[0], "required")
        return names[0], default

    def int(self, *names: str, default: Any = _MISSING, minimum: int = 0) -> Any:
        """The first of `names` that is set, as an int >= `minimum` (or `default` when none is)."""
        name, value = self._raw(names, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise self.error(name, "an integer", value)
        if value < minimum:
            raise self.error(name, f"an integer >= {minimum}", value)
        return value

    def float(self, *names: str, default: Any = _MISSING) -> Any:
        name, value = self._raw(names, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(name, "a number", value)
        return float(value)

    def bool(self, *names: str, default: Any = _MISSING) -> Any:
        name, value = self._raw(names, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, bool):
            raise self.error(name, "true or false", value)
        return value

    def str(self, *names: str, default: Any = _MISSING) -> Any:
        name, value = self._raw(names, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str):
            raise self.error(name, "a string", value)
        return value

    def int_list(self, name: str, default: Any = _MISSING) -> Any:
        _, value = self._raw((name,), default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list) or any(
            isinstance(v, bool) or not isinstance(v, int) for v in value
        ):
            raise self.error(name, "a list of integers", value)
        return tuple(value)

    def str_list(self, name: str, default: Any = _MISSING) -> Any:
        _, value = self._raw((name,), default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list) or any(not isinstance(v, str) for v in value):
            raise self.error(name, "a list of strings", value)
        return tuple(value)

    def section(self, name: str, *, required: bool = False) -> ConfigFields | None:
        """A nested object (e.g. `text_config`), or None when absent and not required."""
        value = self.data.get(name)
        if value is None:
            if required:
                raise self.error(name, "an object")
            return None
        if not isinstance(value, dict):
            raise self.error(name, "an object", value)
        return ConfigFields(value, label=self.label, prefix=f"{self.prefix}{name}.")
