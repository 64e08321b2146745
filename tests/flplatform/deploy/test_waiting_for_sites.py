"""`flplatform server` waiting for its sites to connect.

Each look at Flower's node list is a `flwr supernode list` process (about 1.5 CPU-s):
every 2 s, a server waiting ten minutes for its sites spent most of a core on it. It now
looks at once when its gateway says a site joined or left, and otherwise less often as the
wait goes on. The real ``wait_for_sites`` over a stand-in for Flower's answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

import flplatform.deploy.superlink as superlink
from flplatform.core.errors import RunFailed
from flplatform.core.site_registry import RegisteredSite, SiteRegistry
from flplatform.deploy.addresses import Address
from flplatform.deploy.gateway import JOINED, LEFT
from flplatform.deploy.superlink import ServerPlan, list_wait, node_news, wait_for_sites

REGISTRY = SiteRegistry(
    (RegisteredSite("london", 1, "SHA256:l"), RegisteredSite("ohio", 2, "SHA256:o"))
)


class NodeList:
    """Flower's node list as the sites connect: node → seconds after the start it is online."""

    def __init__(self, online_at: dict[int, float]) -> None:
        self.online_at = online_at
        self.started = time.monotonic()
        self.looks: list[float] = []

    def nodes(self) -> dict[int, str]:
        now = time.monotonic() - self.started
        self.looks.append(now)
        return {n: "online" if now >= at else "registered" for n, at in self.online_at.items()}


class Running:
    returncode = None

    def poll(self) -> None:
        return None


def wait(
    flower: NodeList, timeout: float, *, on_poll: Callable[[], bool], say: Callable[[str], None]
) -> None:
    """``wait_for_sites`` for london and ohio (registered), Flower answering as ``flower``."""
    plan = ServerPlan(
        sites=("london", "ohio"),
        address=Address("127.0.0.1", 9092),
        certs=None,
        wait_timeout=timeout,
    )
    wait_for_sites(
        flower,  # type: ignore[arg-type]
        plan,
        REGISTRY,
        link=Running(),  # type: ignore[arg-type]
        link_log=Path("superlink.log"),
        on_poll=on_poll,
        say=say,
    )


def gateway_says(at: float, started: float) -> Callable[[], bool]:
    """The gateway's reports: one line ("joined: ...") once ``at`` seconds have passed."""
    said: list[bool] = []

    def news() -> bool:
        if not said and time.monotonic() - started >= at:
            said.append(True)
            return True
        return False

    return news


def test_the_wait_between_looks_grows_with_the_wait() -> None:
    # a tenth of the time waited, between the first interval and the longest
    assert list_wait(0.0) == superlink.LIST_INTERVAL_SECONDS == 2.0
    assert list_wait(20.0) == 2.0
    assert list_wait(50.0) == 5.0
    assert list_wait(600.0) == superlink.LIST_LONGEST_SECONDS == 10.0


def test_only_a_node_joining_or_leaving_is_news() -> None:
    assert node_news(["refused 10.0.0.9: no TLS", f"{JOINED} site ohio connected from x"])
    assert node_news([f"{LEFT} site ohio disconnected (x)"])
    flood = "closed 6800 connections that carried no site's request in the last minute"
    assert not node_news(["refused 10.0.0.9: its key is not registered", flood])
    assert not node_news([])


@pytest.mark.parametrize("always", [False, True], ids=["once", "every-look"])
def test_a_site_the_gateway_says_joined_is_looked_for_at_once(
    monkeypatch: pytest.MonkeyPatch, always: bool
) -> None:
    """At once, but never sooner than LIST_INTERVAL_SECONDS after the last look (a
    gateway reporting at every look, as under a flood of joins, sets the pace)."""
    monkeypatch.setattr(superlink, "GATEWAY_LOOK_SECONDS", 0.02)
    monkeypatch.setattr(superlink, "LIST_INTERVAL_SECONDS", 0.2)
    monkeypatch.setattr(superlink, "list_wait", lambda waited: 60.0)  # no look of its own
    flower = NodeList({1: 0.0, 2: 1.0})  # ohio's SuperNode joins a second in
    said: list[str] = []
    news = (lambda: True) if always else gateway_says(1.0, flower.started)
    wait(flower, 60.0, on_poll=news, say=said.append)
    assert said == ["all 2 sites connected: london, ohio"]
    assert 1.0 <= flower.looks[-1] < 1.5
    if always:
        gaps = [b - a for a, b in zip(flower.looks, flower.looks[1:], strict=False)]
        assert min(gaps) >= 0.2 - 0.01 and len(flower.looks) <= 7
    else:
        assert len(flower.looks) == 2  # the first look, then when the gateway said so


def test_without_news_the_looks_grow_apart_and_the_timeout_names_who_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(superlink, "GATEWAY_LOOK_SECONDS", 0.01)
    monkeypatch.setattr(superlink, "LIST_INTERVAL_SECONDS", 0.05)
    monkeypatch.setattr(superlink, "LIST_LONGEST_SECONDS", 0.3)
    flower = NodeList({1: 0.0, 2: float("inf")})  # ohio never comes
    with pytest.raises(RunFailed, match=r"waited 2 s and ohio did not connect \(connected: london"):
        wait(flower, 2.0, on_poll=lambda: False, say=lambda line: None)
    gaps = [b - a for a, b in zip(flower.looks, flower.looks[1:], strict=False)]
    assert flower.looks[-1] >= 2.0  # a last look at the deadline, for the message
    # before it, each gap is at least the wait for the time waited (a tenth of it, 0.05 s
    # at least)
    for waited, gap in zip(flower.looks, gaps[:-1], strict=False):
        assert gap >= min(max(0.05, waited / 10), 0.3) - 0.01, (waited, gap)
    # every 0.05 s, 40 looks; growing apart, about half as many
    assert len(flower.looks) < 28, flower.looks
