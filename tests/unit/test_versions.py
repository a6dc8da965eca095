"""The version vocabulary (fleetrl/versions.py): the labels workers carry."""

import pytest

from fleetrl.versions import parse_version, version_name


def test_a_label_names_its_version():
    assert parse_version(version_name(0)) == 0 and parse_version(version_name(37)) == 37
    assert parse_version("v3") == 3


@pytest.mark.parametrize("label", ["default", "v", "3", "v-1", "v3a", "incomplete-v3", "v²", "v١٢", "v３"])
def test_anything_else_names_no_version(label):
    """Only ASCII digits: str.isdigit() also takes "²" (which int() refuses, a crash) and
    "١٢" or "３" (which int() reads as 12 and 3: a foreign label taken for a version)."""
    assert parse_version(label) is None
