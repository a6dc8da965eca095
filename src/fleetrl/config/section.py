"""The base of every config section: unknown keys and non-finite numbers refused, assignments
validated; and the bounds and checks that several sections share (the longest wait, CPU lists)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from fleetrl.cores import parse_cpus


# The longest any timeout or interval may be: a week. Longer is a hang by another name, and
# the timers under them overflow near 1e15 s (at the first publish, not at start).
MAX_WAIT_S = 7 * 24 * 3600.0


class Section(BaseModel):
    # Numbers must be finite (TOML and the flags accept `nan` and `inf`): a NaN learning rate or
    # timeout would only show up as a broken run much later. The fields where `inf` means "off"
    # say so with `Field(allow_inf_nan=True)` and refuse NaN themselves (`no_nan`).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def no_nan(value: float) -> float:
    if math.isnan(value):
        raise ValueError("must be a number, not nan")
    return value


def check_cpu_lists(value: list[str]) -> list[str]:
    for spec in value:
        parse_cpus(spec)  # its ValueError names the list
    return value
