"""Folders under pytest's base temp that outlive the module that made them: a shared
deployment's (tests/integration/deployments.py), and those of modules that failed, kept for
reading. Every other folder goes as its module ends (tests/conftest.py)."""

from pathlib import Path

KEPT_FOLDERS: set[Path] = set()
