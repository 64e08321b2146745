"""A run whose SuperLink is gone stops, failed with the reason, instead of training on.

The SuperLink is stood in for by what the watch checks, a real listening socket; the
round engine, ``flplatform.start`` and the SQL ledger are the real ones.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.app import Message

from flplatform import keys
from flplatform.engine import link
from flplatform.engine.link import LinkedGrid, SuperLinkWatch, superlink_address, watch_superlink
from flplatform.errors import RunFailed
from flplatform.start import start
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging
from tests.flplatform.engine.scripted_grid import ScriptedGrid
from tests.flplatform.test_start import MODEL, site, trained

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture
def superlink() -> Iterator[socket.socket]:
    """A socket listening on a free loopback port, as the SuperLink's Runtime API does."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server
    server.close()


def test_the_address_is_the_one_flower_started_the_process_with() -> None:
    argv = ["flwr-simulation", "--runtime-api-address", "127.0.0.1:9091", "--token", "t"]
    assert superlink_address(argv) == ("127.0.0.1", 9091)
    assert superlink_address(["flwr-serverapp", "--runtime-api-address=[::1]:9091"]) == (
        "::1",
        9091,
    )
    assert superlink_address(["x", "--simulationio-api-address", "10.0.0.2:7"]) == ("10.0.0.2", 7)
    assert superlink_address(["pytest", "-k", "link"]) is None
    assert superlink_address(["x", "--runtime-api-address"]) is None


def test_a_grid_outside_flower_is_left_as_it_is() -> None:
    grid = ScriptedGrid({})
    assert watch_superlink(grid, argv=["pytest"]) is grid
    watched = watch_superlink(grid, argv=["x", "--runtime-api-address", "127.0.0.1:1"])
    assert isinstance(watched, LinkedGrid)
    assert watch_superlink(watched, argv=["x", "--runtime-api-address", "127.0.0.1:1"]) is watched


def test_the_watch_fails_only_after_the_grace_and_forgives_a_link_that_came_back(
    superlink: socket.socket,
) -> None:
    address = superlink.getsockname()
    now = [0.0]
    watch = SuperLinkWatch(address, grace=3.0, interval=1.0, clock=lambda: now[0])
    watch.check()  # listening
    superlink.close()
    for t in (0.5, 1.0, 2.5):  # probed at 1.0 and 2.5 only; down for 1.5 s: not yet
        now[0] = t
        watch.check()
    now[0] = 4.0
    with pytest.raises(RunFailed, match=rf"SuperLink at 127.0.0.1:{address[1]} is gone \("):
        watch.check()

    # A SuperLink that answers again before the grace resets it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as again:
        again.bind(("127.0.0.1", 0))
        again.listen()
        now[0] = 0.0
        watch = SuperLinkWatch(again.getsockname(), grace=3.0, interval=1.0, clock=lambda: now[0])
        watch._down_since = -2.0  # down since 2 s ago, as far as it knows
        now[0] = 1.0
        watch.check()
        now[0] = 10.0
        watch.check()  # it answered at 1.0: the clock of its absence restarted


def test_a_run_whose_superlink_dies_mid_round_stops_failed_with_the_reason(
    tmp_path: Path, superlink: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As flwr-simulation's in-memory Grid does, the sites go on answering nothing; the
    run stops at the watch's next probe after the grace, not at the round timeout."""
    port = superlink.getsockname()[1]
    monkeypatch.setattr(
        sys, "argv", ["flwr-simulation", "--runtime-api-address", f"127.0.0.1:{port}"]
    )
    monkeypatch.setattr(link, "LINK_GRACE_SECONDS", 0.3)
    monkeypatch.setattr(link, "PROBE_INTERVAL_SECONDS", 0.1)
    honest = site("a", trained(1.0, examples=10, loss=1.0))

    def dies_in_round_2(msg: Message) -> Message | None:
        config = msg.content.config_records.get(keys.CONFIG)
        if config is not None and config.get(keys.SERVER_ROUND) == 2:
            superlink.close()  # the SuperLink is killed while round 2 trains
            return None
        return honest(msg)

    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    with pytest.raises(RunFailed, match="is gone") as raised:
        start(
            LocalSGDAveraging(), ScriptedGrid({1: dies_in_round_2}), MODEL, num_rounds=5, ledger=db
        )
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert (run.status, run.error) == ("failed", raised.value.reason)
        assert f"SuperLink at 127.0.0.1:{port} is gone (connection refused" in (run.error or "")
        assert [r.round for r in repo.list_rounds(run.id)] == [1]
