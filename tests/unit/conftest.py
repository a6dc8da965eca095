"""Unit tests' temporary files land in the test's own tmp_path (tempfile's default folder is
pointed there), so the run directories that helpers make with tempfile.mkdtemp are removed with
pytest's old sessions instead of piling up in /tmp."""

import tempfile

import pytest


@pytest.fixture(autouse=True)
def _temporary_files_in_tmp_path(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
