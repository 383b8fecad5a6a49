"""Reading a parsed YAML configuration strictly: every error names the file, the key path
and what was expected (policy files and recognition profiles share it)."""

from __future__ import annotations

import re
from typing import Any

from .errors import ConfigError

MAX_SECONDS = 1e9  # ~31 years: keeps int(seconds * 1e9) a finite int


class ConfigReader:
    """Walks a parsed YAML mapping, raising ConfigError with file + key path + expectation."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(
        self, path: str, expected: str, got: Any = None, *, show_got: bool = True
    ) -> ConfigError:
        detail = f", got {describe(got)}" if show_got else ""
        return ConfigError(f"{self.source}: {path or '<top level>'}: expected {expected}{detail}")

    def mapping(self, value: Any, path: str, allowed: set[str] | None) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, "a mapping", value)
        for key in value:
            if not isinstance(key, str):
                raise self.fail(path, "string keys", key)
            if allowed is not None and key not in allowed:
                raise ConfigError(
                    f"{self.source}: {join(path, key)}: unknown key; expected one of "
                    + ", ".join(sorted(allowed))
                )
        return value

    def string(self, value: Any, path: str) -> str:
        if isinstance(value, bool) or not isinstance(value, str | int | float) or value == "":
            raise self.fail(path, "a non-empty string", value)
        return str(value)

    def integer(self, value: Any, path: str, minimum: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(path, f"an integer >= {minimum}", value)
        return value

    def number(self, value: Any, path: str, minimum: float = 0.0) -> float:
        # `not minimum <= value <= MAX_SECONDS` also refuses NaN (every comparison is false)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (minimum <= value <= MAX_SECONDS)
        ):
            raise self.fail(path, f"a number >= {minimum} (and <= {MAX_SECONDS:g})", value)
        return float(value)

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, "true or false", value)
        return value

    def strings(self, value: Any, path: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise self.fail(path, "a list of strings", value)
        return tuple(self.string(v, f"{path}[{i}]") for i, v in enumerate(value))

    def regex(self, pattern: str, path: str) -> re.Pattern[str]:
        try:
            return re.compile(pattern)
        except (re.error, OverflowError, RecursionError) as exc:
            raise ConfigError(f"{self.source}: {path}: invalid regex {pattern!r}: {exc}") from None

    def string_or_strings(self, value: Any, path: str) -> tuple[str, ...]:
        if isinstance(value, str):
            return (self.string(value, path),)
        return self.strings(value, path)


def join(path: str, key: str) -> str:
    key = key or "''"  # YAML allows an empty key: still say where
    return f"{path}.{key}" if path else key


def describe(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"boolean {value}"
    if isinstance(value, int | float):
        return f"number {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__
