"""The learning-rate schedule, against rates worked out by hand, and its config checks."""

from __future__ import annotations

import math
import re

import pytest

from fleetrl.config import ConfigError, load_config
from fleetrl.trainer.schedule import Schedule


def test_constant_is_the_default_and_never_moves():
    schedule = Schedule(lr=1e-5, max_steps=10)
    assert [schedule.rate(n) for n in (1, 5, 10, 50)] == [1e-5] * 4


def test_warmup_climbs_linearly_to_the_peak_at_its_last_step():
    schedule = Schedule(lr=1e-5, warmup_steps=4, max_steps=10)
    assert [schedule.rate(n) for n in range(1, 6)] == pytest.approx([2.5e-6, 5e-6, 7.5e-6, 1e-5, 1e-5])


def test_linear_decay_starts_at_the_peak_and_reaches_lr_min_after_its_last_step():
    # warmup 2, then 4 steps of decay from 1.0 toward 0.2: 1.0 - 0.8 * (n - 3) / 4, as step n begins
    schedule = Schedule(lr=1.0, warmup_steps=2, decay="linear", lr_min=0.2, max_steps=6)
    assert [schedule.rate(n) for n in range(1, 9)] == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    assert schedule.rate(6) > 0.2  # the run's last step still learns, lr_min = 0 or not


def test_cosine_decay_is_half_way_down_at_half_the_horizon():
    schedule = Schedule(lr=1.0, decay="cosine", lr_min=0.0, decay_steps=4, max_steps=100)
    expected = [0.5 * (1 + math.cos(math.pi * (n - 1) / 4)) for n in range(1, 6)]  # 1, 0.854, 0.5, 0.146, 0
    assert [schedule.rate(n) for n in range(1, 7)] == pytest.approx(expected + [0.0])
    assert schedule.rate(3) == pytest.approx(0.5)


def test_the_rate_of_a_step_depends_on_the_step_alone():
    """What makes a resume exact: a fresh Schedule gives step n the rate the first one gave."""
    first, resumed = (Schedule(lr=3e-6, warmup_steps=3, decay="cosine", lr_min=1e-7, max_steps=20) for _ in "ab")
    assert [first.rate(n) for n in range(1, 21)] == [resumed.rate(n) for n in range(1, 21)]


@pytest.mark.parametrize(("flags", "field"), [
    ([("trainer.lr_min", "1e-3")], "trainer.lr_min"),
    ([("trainer.lr_decay", "linear"), ("trainer.lr_warmup_steps", "10")], "trainer.lr_warmup_steps"),
    ([("trainer.lr_decay", "step")], "trainer.lr_decay"),
    ([("trainer.lr_warmup_steps", "-1")], "trainer.lr_warmup_steps"),
    ([("trainer.lr_warmup_steps", "11")], "trainer.lr_warmup_steps = 11 is longer than run.max_steps"),
])
def test_a_schedule_that_cannot_run_is_refused_naming_the_field(flags, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config([], flags)


def test_a_decay_over_fixed_steps_may_outlast_warmup_past_max_steps():
    config = load_config([], [("trainer.lr_decay", "linear"), ("trainer.lr_warmup_steps", "10"),
                              ("trainer.lr_decay_steps", "5")])
    assert config.trainer.lr_decay_steps == 5
