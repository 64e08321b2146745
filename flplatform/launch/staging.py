"""An app directory as ``flwr run`` packs it, copied once per version for it to walk.

Flower builds an app's FAB by walking every file under its directory; a virtual
environment inside it (the README's set-up makes ``.venv`` there) costs seconds per
start-up. :func:`staged_app` gives ``flwr run`` a copy holding only what the FAB holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from flplatform.core.errors import RunFailed
from storage.session import flplatform_home

# Directories Flower would walk file by file and pack nothing from: a virtual environment
# inside the app directory (the README's set-up makes .venv there: some 50,000 files, 3.5 s
# of CPU per start-up), git's store, bytecode caches.
NEVER_PACKED = frozenset({".git", "__pycache__"})
STAGED_KEPT_SECONDS = 7 * 24 * 3600  # a staged copy unused this long is removed


def staged_app(app_dir: Path, home: Path) -> Path:
    """A copy of what ``flwr run`` packs from ``app_dir``, for it to walk instead.

    Flower builds the FAB by walking every file under the app directory and filtering
    afterwards. The copy holds the files Flower's own filter keeps (its include and exclude
    patterns, the app's ``.gitignore``), found without entering virtual environments (any
    directory with a ``pyvenv.cfg``), git's store or this platform's home: the FAB holds
    what it held. The copy is named by its contents (``home/apps/<hash>``), made once per
    version of the app and shared by concurrent runs; copies unused for a week are removed.
    """
    from flplatform.core.flower_internals import publish_filter  # imports Flower

    filter_paths_for_publish = publish_filter()  # the filter `flwr run` applies

    root = app_dir.resolve()
    skip = {home.resolve(), flplatform_home().resolve()}
    found: dict[str, Path] = {}
    for directory, subdirs, names in os.walk(root):
        here = Path(directory)
        subdirs[:] = [
            d
            for d in subdirs
            if d not in NEVER_PACKED
            and (here / d).resolve() not in skip
            and not (here / d / "pyvenv.cfg").exists()
        ]
        for name in names:
            path = here / name
            if not path.is_symlink():  # Flower skips symlinks too
                found[path.relative_to(root).as_posix()] = path
    try:
        kept = filter_paths_for_publish(found)
        contents = {
            name: path.read_bytes() if isinstance(path, Path) else path
            for name, path in sorted(kept.items())
        }
    except OSError as exc:
        raise RunFailed(f"cannot read the app directory {root}: {exc}") from exc
    except Exception as exc:  # Flower's own refusal (a path nested too deep, ...)
        raise RunFailed(f"flwr run cannot pack {root}: {exc}") from exc
    digest = hashlib.sha256()
    for name, content in contents.items():
        digest.update(f"{name}\0{len(content)}\0".encode())
        digest.update(content)
    apps = home / "apps"
    staged = apps / digest.hexdigest()[:16]
    if not staged.is_dir():
        apps.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(dir=apps, prefix=".staging-"))
        try:
            for name, content in contents.items():
                target = building / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            building.rename(staged)
        except OSError as exc:
            shutil.rmtree(building, ignore_errors=True)
            if not staged.is_dir():  # not a concurrent run that made the same copy first
                raise RunFailed(f"cannot stage the app {root} in {apps}: {exc}") from exc
    os.utime(staged)  # in use: kept
    _remove_unused(apps, keep=staged)
    return staged


def _remove_unused(apps: Path, *, keep: Path) -> None:
    """Staged copies (and half-made ones) nobody used for ``STAGED_KEPT_SECONDS``."""
    cutoff = time.time() - STAGED_KEPT_SECONDS
    for entry in apps.iterdir():
        with contextlib.suppress(OSError):
            if entry != keep and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry)
