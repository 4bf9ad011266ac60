"""Strict typed access to the fields of a JSON object: a bool is not an int, NaN and infinities are not numbers,
and `null` means "not given". Every violation is an InvalidRequestError naming the field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridpd.errors import InvalidRequestError


@dataclass(frozen=True)
class Fields:
    obj: Mapping[str, Any]
    prefix: str = ""

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def raw(self, key: str) -> Any:
        return self.obj.get(key)

    def fail(self, key: str, message: str) -> InvalidRequestError:
        return InvalidRequestError(f"{self.name(key)} {message}", self.name(key))

    def optional_int(self, key: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
        value = self.obj.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, got {_kind(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be <= {maximum}, got {value}")
        return value

    def int(self, key: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
        value = self.optional_int(key, minimum=minimum, maximum=maximum)
        return default if value is None else value

    def float(self, key: str, default: float) -> float:
        value = self.obj.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"must be a number, got {_kind(value)}")
        try:
            number = float(value)
        except OverflowError as exc:
            raise self.fail(key, "is out of range") from exc
        if not math.isfinite(number):
            raise self.fail(key, "must be a finite number")
        return number

    def bool(self, key: str, default: bool) -> bool:
        value = self.obj.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, f"must be a boolean, got {_kind(value)}")
        return value

    def optional_str(self, key: str) -> str | None:
        value = self.obj.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, got {_kind(value)}")
        return value

    def optional_object(self, key: str) -> Fields | None:
        value = self.obj.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(key, f"must be an object, got {_kind(value)}")
        return Fields(value, f"{self.name(key)}.")


def _kind(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )
