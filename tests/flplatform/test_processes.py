"""Stopping every process a command started, and SIGINT/SIGTERM as ``StopRequested``.

Real processes (``sleep`` under ``sh``) and real signals; Linux ``/proc``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from flplatform.processes import ProcessTree, StopRequested, stop_reason, stop_signals

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")


def pids_running(argv: str) -> list[int]:
    """Live processes whose command line is ``argv`` (arguments joined by spaces)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline == argv and state != "Z":
            found.append(int(entry.name))
    return found


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def wait_for(condition, timeout: float = 10.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def test_stop_ends_orphans_and_processes_that_left_for_a_session_of_their_own() -> None:
    """As Flower and Ray do: a child outlives its parent (re-parented away from us), and
    a grandchild starts a session of its own (SuperExec's); both are found and stopped."""
    # Unique durations name the processes; the subshells exit, orphaning them.
    stay, leave, root = "sleep 301.1", "sleep 301.2", "sleep 301.3"
    tree = ProcessTree()
    tree.popen(["sh", "-c", f"({stay} &); (setsid {leave} & sleep 0.5); exec {root}"])
    try:
        # The session-leaving one is known only if it was seen while still below us.
        [left] = wait_for(lambda: pids_running(leave))
        tree.record()
        assert left in tree.alive()
        [stayed] = wait_for(lambda: pids_running(stay))
        parent = parent_of(left)
        wait_for(lambda: parent_of(left) != parent)  # its subshell exited: an orphan now
        assert os.getsid(left) == left and os.getsid(stayed) != left

        started = time.monotonic()
        assert tree.stop() == []
        assert time.monotonic() - started < 2.0  # sleep exits on SIGTERM: no grace spent
        assert pids_running(stay) == pids_running(leave) == pids_running(root) == []
        assert tree.alive() == []
        assert tree.stop() == []  # again: nothing to do
    finally:
        tree.stop(grace=0)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    tree = ProcessTree()
    proc = tree.popen(["sh", "-c", "trap '' TERM; exec sleep 302.1"])
    try:
        wait_for(lambda: pids_running("sleep 302.1"))
        started = time.monotonic()
        assert tree.stop(grace=0.5) == []
        assert 0.5 <= time.monotonic() - started < 3.0
        assert proc.returncode == -signal.SIGKILL
    finally:
        tree.stop(grace=0)


@pytest.mark.usefixtures("live_sigint")
def test_sigterm_and_sigint_become_stop_requested_once_and_the_handlers_come_back() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(StopRequested) as raised, stop_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here, at once
        except StopRequested:
            os.kill(os.getpid(), signal.SIGINT)  # while stopping: ignored, not raised
            time.sleep(0.1)
            raise
    assert (raised.value.name, raised.value.exit_code) == ("SIGTERM", 143)
    assert stop_reason(raised.value) == "stopped by the user (SIGTERM)"
    assert stop_reason(KeyboardInterrupt()) == "stopped by the user (SIGINT)"
    assert {s: signal.getsignal(s) for s in before} == before

    with pytest.raises(StopRequested) as raised, stop_signals():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    assert (raised.value.name, raised.value.exit_code) == ("SIGINT", 130)
    assert isinstance(raised.value, KeyboardInterrupt)  # Ctrl-C clean-up code runs for both


def test_a_signal_ignored_before_stays_ignored() -> None:
    """A shell starts a background job with SIGINT ignored; SIGTERM still stops it."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
