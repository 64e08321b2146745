"""Sites whose training fails are benched for a few rounds, doubling, so that a site whose
process dies every round does not cost every round its death.

A failed reply (the site's error: its worker process died, its code raised) benches its
site for the next ``2^(n−1)`` rounds, n its failures in a row, at most ``MAX_ROUNDS``: it
is offered no work, and no round waits for it. Then it is tried again; an applied update
ends its streak. A site whose mod refused what its own train function returned is not
benched (the stop rule ends such a run), nor a site that timed out or that the
SuperLink reported unavailable (no reply came from it to say it failed). Never every site:
a failure that would leave no connected site unbenched benches no one, and a round in
which nothing could be sent without the benched sites (a strategy that needs more sites
than are left) offers them work after all (``RoundEngine``).

Sites are kept by name, as a resumed run knows them (node ids change at every start-up).
No Flower imports.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from flplatform.core.checkpoint import StateProblems

MAX_ROUNDS = 16


class SiteBench:
    """Which sites sit out which rounds after failing, and their failures in a row."""

    def __init__(self) -> None:
        self._failures: dict[str, int] = {}  # site → failed replies in a row
        self._until: dict[str, int] = {}  # site → first round it is offered work again

    def failed(self, site: str, server_round: int, *, others: Collection[str]) -> int:
        """Bench ``site`` after a failed reply in ``server_round``; how many rounds (0: not
        benched, as none of the connected ``others`` would be left to train)."""
        self._failures[site] = self._failures.get(site, 0) + 1
        if not [s for s in others if s != site and not self.benched(s, server_round + 1)]:
            return 0
        rounds = min(2 ** (self._failures[site] - 1), MAX_ROUNDS)
        self._until[site] = server_round + 1 + rounds
        return rounds

    def succeeded(self, site: str) -> None:
        """An update of ``site`` was applied: its streak ends."""
        self._failures.pop(site, None)
        self._until.pop(site, None)

    def benched(self, site: str, server_round: int) -> bool:
        """Whether ``site`` sits out ``server_round``."""
        return server_round < self._until.get(site, 0)

    # ------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"failures": dict(self._failures), "until": dict(self._until)}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore ``state_dict()`` output (None: a checkpoint from before benching)."""
        if state is None:
            self._failures, self._until = {}, {}
            return
        problems = StateProblems("the site bench")
        if not problems.require(state, "failures", "until"):
            problems.raise_if_any()
        parts = {}
        for key in ("failures", "until"):
            value = state[key]
            if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in value.items()
            ):
                problems.add(f"'{key}' must map site names to counts")
            else:
                parts[key] = dict(value)
        problems.raise_if_any()
        self._failures, self._until = parts["failures"], parts["until"]
