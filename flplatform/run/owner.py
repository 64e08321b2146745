"""The command that owns a simulation: who it is, and whether it is still there.

A command that starts a simulation (``flplatform simulate``, ``run``, ``demo``, a sweep)
names itself in the environment of the Flower processes it starts (``FLPLATFORM_OWNER``:
its pid and start time, so that a later process reusing the pid is not taken for it).
Killed with SIGKILL (the OOM killer, ``kill -9``, a closed terminal) it cannot stop what
it started. Its SuperLink dies with it (``launch.processes``), but the simulation below
SuperExec does not: Flower's simulation moves its messages in memory, so its ServerApp
would train on and write rounds into a run nobody follows. So the simulation watches its
owner (``launch.simulation_runtime``) and ends every process of the federation once it is
gone, and the ledger writes no round for a run whose owner is gone. Linux only (``/proc``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

OWNER_ENV = "FLPLATFORM_OWNER"


def stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name: state, ppid, pgrp, session, ..., start
    time (index 19); None when the process is not there (or there is no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # it exited while we looked
        return None
    # pid (comm) state ...: comm may hold spaces and parentheses, so split after its last ")"
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields if len(fields) >= 20 else None


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None if it is not running
    (a zombie has exited) or there is no ``/proc``."""
    fields = stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def owner_token(pid: int | None = None) -> str | None:
    """``"PID:START"`` naming process ``pid`` (this one by default); None without ``/proc``."""
    pid = os.getpid() if pid is None else pid
    started = start_time(pid)
    return None if started is None else f"{pid}:{started}"


def named_owner(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """The (pid, start time) ``FLPLATFORM_OWNER`` names; None when it names none."""
    token = (os.environ if environ is None else environ).get(OWNER_ENV, "")
    pid, _, started = token.partition(":")
    if not (pid.isdecimal() and started.isdecimal()):
        return None
    return int(pid), int(started)


def owner_gone(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the command named by ``FLPLATFORM_OWNER`` has ended (False when it names
    none: then nobody is watched)."""
    owner = named_owner(environ)
    return owner is not None and start_time(owner[0]) != owner[1]
