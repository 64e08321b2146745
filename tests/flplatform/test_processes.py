"""Stopping every process a command started, SIGINT/SIGTERM as ``StopRequested``, and
the sockets processes listen on.

Real processes (``sleep`` under ``sh``), real signals and real sockets; Linux ``/proc``.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flplatform.launch.processes import (
    ListeningSocket,
    ProcessTree,
    StopRequested,
    listening_sockets,
    parse_proc_net,
    stop_reason,
    stop_signals,
)

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
        assert tree.stop(grace=30) == []
        assert time.monotonic() - started < 10  # sleep exits on SIGTERM: no grace spent
        assert pids_running(stay) == pids_running(leave) == pids_running(root) == []
        assert tree.alive() == []
        assert tree.stop() == []  # again: nothing to do
    finally:
        tree.stop(grace=0)


def test_a_child_adopted_in_our_own_session_does_not_put_that_session_in_the_tree() -> None:
    """A process the command started without a session of its own shares the caller's
    session (the user's shell): stopping the tree ends that process and what it started,
    never the rest of the session. Run in a session of its own, so that a regression
    stops that session, not pytest's."""
    code = (
        "import os, subprocess, time\n"
        "from flplatform.launch.processes import ProcessTree\n"
        "bystander = subprocess.Popen(['sleep', '303.2'])  # our session, not the tree's\n"
        "tree = ProcessTree()\n"
        "adopted = tree.adopt(subprocess.Popen(['sh', '-c', 'sleep 303.1 & exec sleep 303.3']))\n"
        "time.sleep(0.5)\n"
        "assert os.getsid(adopted.pid) == os.getsid(0) == os.getsid(bystander.pid) != os.getpid()\n"
        "tree.record()\n"
        "assert tree.stop() == []\n"
        "assert bystander.poll() is None, 'a process of our own session was stopped'\n"
        "bystander.kill()\n"
        "print('bystander kept')\n"
    )
    # sh leads the new session and Python runs below it, as a command below a user's shell
    # (a command that leads its session holds only what it started: all of it is its tree)
    done = subprocess.run(
        ["sh", "-c", '"$0" -c "$1"; exit $?', sys.executable, code],
        capture_output=True,
        text=True,
        start_new_session=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "bystander kept"), done.stderr
    assert pids_running("sleep 303.1") == pids_running("sleep 303.3") == []


def test_a_command_that_leads_its_session_stops_all_of_it() -> None:
    """``setsid flplatform ...``: every process of the session came from the command, so an
    orphan a child left there (not below us any more, never recorded) is stopped too."""
    code = (
        "import os, subprocess, time\n"
        "from flplatform.launch.processes import ProcessTree\n"
        "assert os.getsid(0) == os.getpid()\n"
        "tree = ProcessTree()\n"
        "tree.adopt(subprocess.Popen(['sh', '-c', '(sleep 304.1 &); exec sleep 304.2']))\n"
        "time.sleep(0.5)  # the subshell has exited: sleep 304.1 is an orphan in our session\n"
        "assert tree.stop() == []\n"
        "print('stopped')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        start_new_session=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "stopped"), done.stderr
    assert pids_running("sleep 304.1") == pids_running("sleep 304.2") == []


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    tree = ProcessTree()
    proc = tree.popen(["sh", "-c", "trap '' TERM; exec sleep 302.1"])
    try:
        wait_for(lambda: pids_running("sleep 302.1"))
        started = time.monotonic()
        assert tree.stop(grace=0.5, kill_wait=30) == []
        assert 0.5 <= time.monotonic() - started < 10  # not the 30 s wait after SIGKILL
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


# ================================================================ listening sockets
# As a little-endian Linux prints them: each 32-bit word of an address in host byte order.
PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0000000000000000 100 0 0 10 0
   1: 00000000:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4343 1 0000000000000000 100 0 0 10 0
   2: 020200C0:B5C2 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 4444 1 0000000000000000 20 4 30 10 -1
"""  # noqa: E501 (lines as the kernel writes them)
PROC_NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:0BB8 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 5151 1 0000000000000000 100 0 0 10 0
   1: 0000000000000000FFFF00000100007F:A1B2 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 5252 1 0000000000000000 100 0 0 10 0
   2: 00000000000000000000000000000000:8674 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 5353 1 0000000000000000 100 0 0 10 0
   3: B80D0120000000000000000001000000:0016 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5454 1 0000000000000000 100 0 0 10 0
"""  # noqa: E501


@pytest.mark.skipif(sys.byteorder != "little", reason="the samples are a little-endian kernel's")
def test_proc_net_tables_are_parsed_into_addresses_ports_states_and_inodes() -> None:
    def entries(text: str) -> list[tuple[object, int, int, int]]:
        return [(e.address, e.port, e.state, e.inode) for e in parse_proc_net(text)]

    ip = ipaddress.ip_address
    assert entries(PROC_NET_TCP) == [
        (ip("127.0.0.1"), 8080, 0x0A, 4242),
        (ip("0.0.0.0"), 80, 0x0A, 4343),
        (ip("192.0.2.2"), 46530, 0x01, 4444),  # a connection's local end
    ]
    assert entries(PROC_NET_TCP6) == [
        (ip("::1"), 3000, 0x0A, 5151),
        (ip("::ffff:127.0.0.1"), 41394, 0x0A, 5252),  # gRPC's IPv6 socket on 127.0.0.1
        (ip("::"), 34420, 0x0A, 5353),
        (ip("2001:db8::1"), 22, 0x0A, 5454),
    ]


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.0.2.2", False),
        ("::ffff:192.0.2.2", False),
        ("2001:db8::1", False),
    ],
)
def test_only_loopback_addresses_count_as_loopback(address: str, loopback: bool) -> None:
    listening = ListeningSocket(1, "raylet", "tcp", ipaddress.ip_address(address), 6379)
    assert listening.loopback is loopback


def test_a_listening_socket_reads_as_ss_shows_it() -> None:
    def shown(address: str) -> str:
        return str(ListeningSocket(7, "raylet", "tcp", ipaddress.ip_address(address), 6379))

    assert shown("127.0.0.1") == "tcp 127.0.0.1:6379 (raylet, pid 7)"
    assert shown("::") == "tcp [::]:6379 (raylet, pid 7)"
    assert shown("::ffff:127.0.0.1") == "tcp [::ffff:127.0.0.1]:6379 (raylet, pid 7)"


def test_the_sockets_a_process_listens_on_are_found_and_its_connections_are_not() -> None:
    with (
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp,
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as tcp6,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as client,
    ):
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        tcp6.bind(("::", 0))
        tcp6.listen()
        udp.bind(("0.0.0.0", 0))
        client.connect(tcp.getsockname())
        found = {s.port: s for s in listening_sockets([os.getpid()])}

        assert [
            (found[port].protocol, str(found[port].address), found[port].loopback)
            for port in (tcp.getsockname()[1], tcp6.getsockname()[1], udp.getsockname()[1])
        ] == [("tcp", "127.0.0.1", True), ("tcp", "::", False), ("udp", "0.0.0.0", False)]
        assert client.getsockname()[1] not in found  # a connection listens on nothing
        assert found[tcp.getsockname()[1]].pid == os.getpid()


def test_processes_that_are_gone_are_left_out() -> None:
    proc = ProcessTree().popen(["true"])
    proc.wait()
    assert listening_sockets([proc.pid]) == []
