"""The stop rule: a run that keeps failing the same way stops with ``NoProgress``.

``FailureStreak`` watches finished rounds; ``reason_key`` is how it compares failure
reasons. The round engine feeds it every round once the round is in the ledger.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from flplatform.core.checkpoint import StateProblems
from flplatform.core.errors import ConfigError, NoProgress
from flplatform.engine.events import UpdateOutcome

# Rounds in a row that may fail the same way before the run stops (0: never stop).
DEFAULT_MAX_FAILED_ROUNDS = 3
# Numbers (hex addresses first) in a failure reason: replaced when reasons are compared.
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+")
# A failure reason is cut to this many characters in the error that stops the run.
REASON_SHOWN = 300


class FailureStreak:
    """The stop rule: rounds in a row that applied nothing because every reply failed alike.

    A round *counts* when it applied no update, at least one reply came back and failed (a
    site's error, or an update the strategy rejected), and every reply that failed did so
    for the same reason. It extends the streak when its reason is the streak's; any other
    round ends the streak (a counting round with a new reason starts a new one). When
    ``limit`` rounds count in a row, ``observe`` raises ``NoProgress``.

    Reasons are compared with whitespace collapsed and every number (and hex address)
    replaced, so sites whose error differs only in a size, an index or an address (``shape
    (10, 64)`` here, ``(10, 32)`` there) fail alike; different words never do.

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
        self._key: str | None = None  # their reason, as compared
        self._statuses: set[str] = set()

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
            When ``limit`` counting rounds in a row failed for the same reason.
        """
        keys_seen = {reason_key(u.reason) for u in failed_replies}
        if applied or len(keys_seen) != 1:
            self._reset()
            return
        (key,) = keys_seen
        if key != self._key:
            self._reset()
            self._key = key
        self.rounds.append(server_round)
        self._statuses.update(u.status for u in failed_replies)
        if self.limit and len(self.rounds) >= self.limit:
            raise NoProgress(self._describe(failed_replies[-1].reason))

    def state_dict(self) -> dict[str, Any]:
        """The current streak: its rounds, their reason (as compared) and statuses."""
        return {"rounds": list(self.rounds), "key": self._key, "statuses": set(self._statuses)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (``CheckpointError`` listing every problem)."""
        problems = StateProblems("the stop rule")
        if not problems.require(state, "rounds", "key", "statuses"):
            problems.raise_if_any()
        rounds, key, statuses = state["rounds"], state["key"], state["statuses"]
        if not isinstance(rounds, list) or not all(
            problems.number(r, "rounds", integer=True) for r in rounds
        ):
            problems.add("'rounds' must be a list of round numbers")
        if key is not None and not isinstance(key, str):
            problems.add("'key' must be text")
        if not isinstance(statuses, set | list) or not all(isinstance(s, str) for s in statuses):
            problems.add("'statuses' must be a set of statuses")
        problems.raise_if_any()
        self.rounds, self._key, self._statuses = list(rounds), key, set(statuses)

    def _reset(self) -> None:
        self.rounds, self._key, self._statuses = [], None, set()

    def _describe(self, reason: str | None) -> str:
        first, last = self.rounds[0], self.rounds[-1]
        span = f"round {first}" if first == last else f"rounds {first}-{last}"
        how = " or ".join(sorted(self._statuses))
        text = " ".join((reason or "no reason given").split())
        if len(text) > REASON_SHOWN:
            text = text[: REASON_SHOWN - 1] + "…"
        return (
            f"{span} applied no update: every reply was {how}: {text} "
            f"(stopped after {self.limit} such rounds in a row; max-failed-rounds 0 never stops)"
        )


def reason_key(reason: str | None) -> str:
    """A failure reason as the stop rule compares it: whitespace collapsed, numbers as '#'.

    ``"array 'w' has shape (10, 64), expected (10, 32)"`` and the same with ``(10, 16)``
    compare equal; ``"missing arrays: w"`` and ``"unexpected arrays: v"`` do not.
    """
    return _NUMBER.sub("#", " ".join((reason or "").split()))
