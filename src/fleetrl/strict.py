"""Strict records: pydantic models read strictly (a key missing or unknown, or a value of another
type, is a `RecordError` that names the record and each key: no int read as a bool, no str as a
number) and frozen once made. The run files' records (records.py) and the weight transports' wire
records (weights/*/wire.py) are these. A leaf: worker ranks read wire records through it too.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from fleetrl.errors import FleetrlError


class RecordError(FleetrlError, ValueError):
    """JSON that is not of its record type."""


class Strict(BaseModel):
    """A record: its fields are its JSON object's keys, each value of its field's type, no key
    unknown; it never changes once made."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    @classmethod
    def read(cls, data: Any, where: str) -> typing.Self:
        """`data` (decoded JSON) as this record, or a RecordError naming `where` and each key."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise RecordError(f"{where}: {problems(cls, e)}") from None

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON has it."""
        return self.model_dump(mode="json")


def problems(cls: type[BaseModel], error: ValidationError) -> str:
    """A validation error in one line: the keys unknown and missing, then each value of another
    type, then what the record's own checks refused."""
    unknown, missing, wrong = [], [], []
    for problem in error.errors(include_url=False):
        where = ".".join(str(part) for part in problem["loc"])
        if problem["type"] == "extra_forbidden":
            unknown.append(where)
        elif problem["type"] == "missing":
            missing.append(where)
        elif problem["type"] == "model_type" and not problem["loc"]:
            return f"not an object but {type(problem['input']).__name__}"
        elif problem["type"] == "value_error":  # a record's own check: its message says it all
            wrong.append(str(problem["ctx"]["error"]))
        else:  # pydantic says "Input should be a valid integer", and the like
            expected = problem["msg"].removeprefix("Input should be ")
            said = f"not {expected}" if expected != problem["msg"] else expected
            wrong.append(f"{where} is {problem['input']!r}, {said}")
    keys = [f"{what} {', '.join(names)}" for what, names in (("unknown", unknown), ("missing", missing)) if names]
    article = "an" if cls.__name__[0] in "AEIOU" else "a"
    return f"not {article} {cls.__name__}: " + "; ".join(keys + wrong)
