"""Training that diverges: noticed after each round, reported once per run, with its likely fix.

A run whose loss turns non-finite, or grows past ``FACTOR`` times its first value, does
not recover by itself: its accuracy soon sits at the majority class while the run goes
on to "finish". ``DivergenceWatch`` looks at every round's losses; the engine puts what it
finds in the round's ``RoundSummary.warning`` (the run log, the ledger, the CLI).

The *first value* is the earliest loss the run has: the received model's loss on the first
mini-batch (``first-batch-loss``, which flplatform's site reports) of the first round that
reports one, else the first round's train loss. The first-batch loss is what catches a run
that blows up within round 1 (scikit-learn's raw wine: first-batch loss 5.6, round-1 train
loss 1e5); with the train loss alone, that round would be its own reference.

The likely fix is named when sites said, in their introduction, that their features are far
from unit scale (``feature-scale``, the largest per-feature RMS, outside ``UNIT_SCALE``):
standardise them at each site (``standardize-features``). A plain Flower ClientApp that
says nothing gets the report without the hint. Pure Python: no Flower, no torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flplatform.core.checkpoint import StateProblems

# A round's train loss above this many times the run's first loss is divergence.
FACTOR = 10.0
# Feature scales (largest per-feature RMS) outside this range are far from unit scale.
UNIT_SCALE = (0.1, 10.0)
# Sites named in one report; the rest are counted.
SITES_NAMED = 5
# Characters of a refused reply's reason quoted in a report.
REASON_QUOTED = 160
# A refused reply whose reason says this sent non-finite values: a site whose training
# diverged sends a NaN model (flplatform's mods refuse it at the site, strategies at the
# server), never a loss the server could read.
_NON_FINITE = re.compile(r"\bnan\b|\binf(inity)?\b|non-finite", re.IGNORECASE)
# The sites then evaluate the model (the server's test set stays unscaled): hence the
# fraction-evaluate the configuration asks for with it.
FIX = (
    "standardise them at each site with its own training statistics: "
    "standardize-features = true (on the CLI: --standardize-features --fraction-evaluate 1)"
)


@dataclass(frozen=True)
class ReportedLoss:
    """The losses one reply reported, as sent (NaN and infinities kept); None: not sent.

    ``refused``: why the reply was dropped or rejected, when it was (a site's error, or
    the strategy's reason).
    """

    site: str
    num_examples: int | None
    train_loss: float | None
    first_batch_loss: float | None
    refused: str | None = None


@dataclass(frozen=True)
class Divergence:
    """Training diverged at ``server_round``; ``finding`` says with which numbers."""

    server_round: int
    finding: str

    def describe(self, feature_scales: Mapping[str, float | None]) -> str:
        """The report, with the likely fix when some site's features are far from unit scale.

        Parameters
        ----------
        feature_scales : mapping
            Site name → the feature scale it reported (None: it did not say).
        """
        text = f"round {self.server_round}: training diverged: {self.finding}"
        far = far_from_unit_scale(feature_scales)
        if not far:
            return text
        named = ", ".join(f"{site} ({scale:.3g})" for site, scale in far[:SITES_NAMED])
        more = f" and {len(far) - SITES_NAMED} more" if len(far) > SITES_NAMED else ""
        low, high = UNIT_SCALE
        return (
            f"{text}. Likely fix: the features of site(s) {named}{more} are far from unit "
            f"scale (largest per-feature RMS outside [{low:g}, {high:g}]); {FIX}"
        )


class DivergenceWatch:
    """Notices the first round whose loss is non-finite or beyond ``factor`` × the first.

    A round diverges when its train loss is non-finite, when any reply reported a
    non-finite train or first-batch loss (the ledger keeps only finite losses, so this is
    read from the replies themselves) or was refused for NaN or infinite values (a model
    gone NaN), or when its train loss exceeds ``factor`` times the
    run's first loss (see the module; a first loss <= 0 is no scale to compare with). It is
    reported once: after the first report, ``observe`` returns None.

    Parameters
    ----------
    factor : float
        How many times the first loss a round's train loss may reach.
    """

    def __init__(self, factor: float = FACTOR) -> None:
        self.factor = factor
        self.first: float | None = None  # the run's first loss, once known
        self.first_from = ""  # where it came from, for the report
        self.reported = False

    def observe(
        self, server_round: int, *, train_loss: float | None, reported: Sequence[ReportedLoss]
    ) -> Divergence | None:
        """Take one finished round into account; return its divergence, the first time only.

        Parameters
        ----------
        server_round : int
            The round.
        train_loss : float or None
            The round's train loss (the engine's example-weighted mean over its applied
            updates, or the strategy's); None when it has none.
        reported : sequence of ReportedLoss
            What each reply of the round reported.
        """
        if self.reported:
            return None
        found = self._judge(server_round, train_loss, reported)
        self.reported = found is not None
        return found

    def state_dict(self) -> dict[str, Any]:
        """The run's first loss, where it came from, and whether divergence was reported."""
        return {"first": self.first, "first_from": self.first_from, "reported": self.reported}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (``CheckpointError`` listing every problem)."""
        problems = StateProblems("the divergence watch")
        if not problems.require(state, "first", "first_from", "reported"):
            problems.raise_if_any()
        if state["first"] is not None:
            problems.number(state["first"], "first")
        if not isinstance(state["first_from"], str):
            problems.add("'first_from' must be text")
        if not isinstance(state["reported"], bool):
            problems.add("'reported' must be true or false")
        problems.raise_if_any()
        self.first = None if state["first"] is None else float(state["first"])
        self.first_from, self.reported = state["first_from"], state["reported"]

    def _judge(
        self, server_round: int, train_loss: float | None, reported: Sequence[ReportedLoss]
    ) -> Divergence | None:
        if train_loss is not None and not math.isfinite(train_loss):
            return Divergence(server_round, f"the round's train loss is {train_loss}")
        non_finite = [_non_finite(r) for r in reported]
        said = [text for text in non_finite if text]
        if said:
            more = f" and {len(said) - SITES_NAMED} more" if len(said) > SITES_NAMED else ""
            return Divergence(
                server_round,
                f"non-finite values from {', '.join(said[:SITES_NAMED])}{more}",
            )
        if self.first is None:
            self._take_first(server_round, train_loss, reported)
        if (
            train_loss is not None
            and self.first is not None
            and self.first > 0
            and train_loss > self.factor * self.first
        ):
            return Divergence(
                server_round,
                f"train loss {train_loss:.4g} is more than {self.factor:g}× the first loss "
                f"{self.first:.4g} ({self.first_from})",
            )
        return None

    def _take_first(
        self, server_round: int, train_loss: float | None, reported: Sequence[ReportedLoss]
    ) -> None:
        """The run's first loss: this round's first-batch losses, else its train loss.

        Only replies that counted: a refused one's loss (a hostile site's 10⁻⁹ over its
        claimed 10¹² examples) would set a scale that every honest round then exceeds."""
        pairs = [
            (r.num_examples or 1, r.first_batch_loss)
            for r in reported
            if r.first_batch_loss is not None and r.refused is None
        ]
        if pairs:
            total = sum(n for n, _ in pairs)
            self.first = sum(n * loss for n, loss in pairs) / total
            self.first_from = f"the sites' first-batch loss in round {server_round}"
        elif train_loss is not None:
            self.first = train_loss
            self.first_from = f"round {server_round}'s train loss"


def far_from_unit_scale(feature_scales: Mapping[str, float | None]) -> list[tuple[str, float]]:
    """The sites whose reported feature scale is outside ``UNIT_SCALE``, in the given order."""
    low, high = UNIT_SCALE
    return [
        (site, scale)
        for site, scale in feature_scales.items()
        if scale is not None and not low <= scale <= high
    ]


def _non_finite(reported: ReportedLoss) -> str:
    """``"london (train loss nan)"`` when a reply reported a non-finite loss or was refused
    for non-finite values (``"london (refused: ... NaN or Inf ...)"``), else ''."""
    bad = [
        f"{name} {value}"
        for name, value in (
            ("train loss", reported.train_loss),
            ("first-batch loss", reported.first_batch_loss),
        )
        if value is not None and not math.isfinite(value)
    ]
    reason = " ".join((reported.refused or "").split())
    if _NON_FINITE.search(reason):
        cut = reason if len(reason) <= REASON_QUOTED else reason[: REASON_QUOTED - 1] + "…"
        bad.append(f"refused: {cut}")
    return f"{reported.site} ({', '.join(bad)})" if bad else ""
