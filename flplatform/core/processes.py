"""Whether a process of this machine still runs: the one rule the ledger's run owners and
the sites' snapshot writers are both judged by."""

from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (another user's counts); a zombie not
    yet reaped does not: it will never write again."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, another user's (whose /proc entry may be hidden)
        return not _ended(pid, missing_means_ended=False)
    return not _ended(pid, missing_means_ended=True)


def _ended(pid: int, *, missing_means_ended: bool) -> bool:
    """Whether ``pid``, which signal 0 still reaches, has ended: a zombie not yet reaped. A
    killed run's server process stays one where nothing reaps orphans (a container whose PID 1
    is not an init), yet it will never write to the run again.

    ``missing_means_ended``: whether a missing ``/proc`` entry means reaped meanwhile (our
    own process) rather than hidden (another user's, under ``hidepid``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:  # no /proc at all (macOS): signal 0 is all there is
        return missing_means_ended and Path("/proc/self/stat").exists()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] in (["Z"], ["X"])
