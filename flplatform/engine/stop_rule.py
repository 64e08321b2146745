"""The stop rule: a run whose rounds keep applying nothing stops with ``NoProgress``.

``FailureStreak`` watches finished rounds; ``reason_key`` is how it tells failure reasons
apart. The round engine feeds it every round once the round is in the ledger.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from flplatform.core.checkpoint import StateProblems
from flplatform.core.errors import ConfigError, NoProgress
from flplatform.engine.events import REJECTED, UpdateOutcome
from flplatform.engine.rows import SITE_REFUSED

# Rounds in a row that may apply nothing before the run stops (0: never stop).
DEFAULT_MAX_FAILED_ROUNDS = 3
# ... and rounds in a row whose every failed reply the sites' own mods refused: the mod
# refused what the app's train function returned, which the same code returns again.
SITE_REFUSALS_MAX_ROUNDS = 2
# Numbers (hex addresses first) in a failure reason: replaced when reasons are compared.
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+")
# The error that stops the run names this many distinct reasons, cut to this many characters.
REASONS_SHOWN = 3
REASON_SHOWN = 300


class FailureStreak:
    """The stop rule: rounds in a row that applied nothing although replies came back.

    A round *counts* when it applied no update and at least one reply came back and failed
    (a site's error, an update the site's mod or the strategy rejected), whatever the
    reasons: sites failing in different ways, or one way this round and another the next,
    make no more progress than sites failing alike. Any other round ends the streak. When
    ``limit`` rounds count in a row, ``observe`` raises ``NoProgress`` naming the streak's
    distinct reasons, the latest first (at most ``REASONS_SHOWN``). A streak in which every
    failed reply was refused at its site (the mod refused what the user's train function
    returned: a mistake in the app, not bad luck) trips after at most
    ``SITE_REFUSALS_MAX_ROUNDS``.

    Reasons are told apart with whitespace collapsed and every number (and hex address)
    replaced (``reason_key``), so sites whose error differs only in a size, an index or an
    address (``shape (10, 64)`` here, ``(10, 32)`` there) are named once.

    Rounds that legitimately apply nothing do not count: a sketch round applies no model
    change but accepts its updates (they are APPLIED); a round in which no reply landed (a
    pipelined round whose period was done early), or only timeouts, refusals, cancelled
    stragglers, absent sites and updates the synchrony policy dropped as stale, ends the
    streak. Messages that brought no reply say nothing about the replies and are ignored
    in a round that counts.

    Parameters
    ----------
    limit : int
        Rounds in a row that trip the rule; 0 never trips.

    Raises
    ------
    ConfigError
        If ``limit`` is not an integer >= 0.
    """

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ConfigError(
                f"max-failed-rounds must be an integer >= 0 (0: never stop), got {limit!r}"
            )
        self.limit = limit
        self.rounds: list[int] = []  # the rounds of the current streak
        self._reasons: dict[str, str] = {}  # reason_key → its latest text, oldest first
        self._statuses: set[str] = set()
        self._site_refusals_only = True

    def observe(
        self, server_round: int, *, applied: int, failed_replies: Sequence[UpdateOutcome]
    ) -> None:
        """Take one finished round into account; raise ``NoProgress`` when the rule trips.

        Parameters
        ----------
        server_round : int
            The round that just finished (and is already recorded).
        applied : int
            Updates the round accepted.
        failed_replies : Sequence[UpdateOutcome]
            The round's replies that came back and failed (each with its reason).

        Raises
        ------
        NoProgress
            When ``limit`` rounds in a row applied nothing and had failed replies.
        """
        if applied or not failed_replies:
            self._reset()
            return
        self.rounds.append(server_round)
        self._statuses.update(u.status for u in failed_replies)
        self._site_refusals_only &= all(_refused_at_site(u) for u in failed_replies)
        for update in failed_replies:
            text = " ".join((update.reason or "no reason given").split())
            self._reasons.pop(reason_key(text), None)  # to the end: the latest
            self._reasons[reason_key(text)] = text
        while len(self._reasons) > REASONS_SHOWN:
            del self._reasons[next(iter(self._reasons))]
        if self.limit and len(self.rounds) >= self._trips_after():
            raise NoProgress(self._describe())

    def state_dict(self) -> dict[str, Any]:
        """The current streak: its rounds, the reasons it names and their statuses."""
        return {
            "rounds": list(self.rounds),
            "reasons": list(self._reasons.values()),
            "statuses": set(self._statuses),
            "site_refusals_only": self._site_refusals_only,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (``CheckpointError`` listing every problem)."""
        problems = StateProblems("the stop rule")
        if not problems.require(state, "rounds", "statuses"):
            problems.raise_if_any()
        # A checkpoint of 2026-11-28 and before kept the streak's reason as compared
        # ("key"), not its texts: resumed, its streak names no reason.
        rounds, reasons, statuses = state["rounds"], state.get("reasons", []), state["statuses"]
        # Before 2026-11-29 every streak tripped after ``limit`` rounds.
        site_refusals_only = state.get("site_refusals_only", False)
        if not isinstance(rounds, list) or not all(
            problems.number(r, "rounds", integer=True) for r in rounds
        ):
            problems.add("'rounds' must be a list of round numbers")
        if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
            problems.add("'reasons' must be a list of texts")
        if not isinstance(statuses, set | list) or not all(isinstance(s, str) for s in statuses):
            problems.add("'statuses' must be a set of statuses")
        if not isinstance(site_refusals_only, bool):
            problems.add("'site_refusals_only' must be true or false")
        problems.raise_if_any()
        self.rounds, self._statuses = list(rounds), set(statuses)
        # No streak: the next one starts as any does (only refusals until one is not).
        self._site_refusals_only = bool(site_refusals_only) if rounds else True
        self._reasons = {reason_key(text): text for text in reasons}

    def _reset(self) -> None:
        self.rounds, self._reasons, self._statuses = [], {}, set()
        self._site_refusals_only = True

    def _trips_after(self) -> int:
        if self._site_refusals_only:
            return min(self.limit, SITE_REFUSALS_MAX_ROUNDS)
        return self.limit

    def _describe(self) -> str:
        first, last = self.rounds[0], self.rounds[-1]
        span = f"round {first}" if first == last else f"rounds {first}-{last}"
        how = " or ".join(sorted(self._statuses))
        text = "; ".join(reversed(self._reasons.values()))
        if len(text) > REASON_SHOWN:
            text = text[: REASON_SHOWN - 1] + "…"
        if self._site_refusals_only and self._trips_after() < self.limit:
            why = (
                f"stopped after {self._trips_after()} rounds in a row: the sites' mods refused "
                "what the app's train function returned; fix the app or its settings"
            )
        else:
            why = f"stopped after {self.limit} such rounds in a row"
        return (
            f"{span} applied no update: every reply was {how}: {text} "
            f"({why}; max-failed-rounds 0 never stops)"
        )


def _refused_at_site(update: UpdateOutcome) -> bool:
    return update.status == REJECTED and (update.reason or "").startswith(SITE_REFUSED)


def reason_key(reason: str | None) -> str:
    """A failure reason as the stop rule tells reasons apart: whitespace collapsed, numbers as '#'.

    ``"array 'w' has shape (10, 64), expected (10, 32)"`` and the same with ``(10, 16)``
    compare equal; ``"missing arrays: w"`` and ``"unexpected arrays: v"`` do not.
    """
    return _NUMBER.sub("#", " ".join((reason or "").split()))
