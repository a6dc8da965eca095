"""The version vocabulary (fleetrl/versions.py): the labels workers carry."""

import pytest

from fleetrl.versions import Label, incomplete_label, parse_label, version_label


def test_a_label_names_its_version_and_its_run():
    assert parse_label(version_label(0, "a1b2c3")) == Label(0, "a1b2c3")
    assert parse_label(version_label(37, "run9")) == Label(37, "run9")
    assert parse_label("v3@beef") == Label(3, "beef")


@pytest.mark.parametrize("label", [
    "default", "v", "3", "v-1", "v3a", "v²", "v١٢", "v３",
    "v3",  # no run: a label fleetrl does not write (by hand, or by another program)
    "v3@", "v3@a b", "v3@ü", "v3@a@b", incomplete_label(3, "beef"),
])
def test_anything_else_names_no_version(label):
    """Only ASCII digits: str.isdigit() also takes "²" (which int() refuses, a crash) and
    "١٢" or "３" (which int() reads as 12 and 3: a foreign label taken for a version). A label
    without its run's identity could be any run's."""
    assert parse_label(label) is None
