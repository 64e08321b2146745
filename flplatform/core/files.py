"""Directories the platform makes for secrets and private state: owner-only, every one."""

from __future__ import annotations

from pathlib import Path


def make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and each missing directory above it owner-only (0700).

    ``mkdir(parents=True, mode=0o700)`` gives the mode to the last one alone: the ones
    above get the umask's (0755), and their names (a run's key, a site's name, a
    deployment's) are listed to every local user. Directories that exist keep their mode.
    """
    missing = []
    current = directory
    while not current.exists():
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        path.mkdir(mode=0o700, exist_ok=True)
