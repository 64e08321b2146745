"""Delayed compensated updates: a site's bookkeeping of its unsettled periods (pure maths).

ALGORITHMS.md §2 (DTS, "Distributed Training Across the World"; DGA). Site n trains p
local steps per period from its local model, giving the accumulated step A_{n,r}; it
applies A_{n,r} at once, sends it, and keeps it. The average of round r,
Ā_r = Σ_n w_n A_{n,r} over the sites whose round-r update was included, reaches it D
rounds later, and the site swaps its own contribution for it:

    x_local ← x_local − A_{n,r} + Ā_r

so that after every round every replica is

    x_local = x_0 + Σ_{j ≤ r−D} Ā_j + Σ_{r−D < j ≤ r} A_{n,j}     (the invariant).

Here the server sends the global model x_v = x_0 + Σ_{j ≤ v} Ā_j of version v (the same
bytes as Ā_v) and the site rebuilds ``x_local = x_v + Σ_{j > v} A_{n,j}``: the swap in
closed form, so replicas agree on the averaged history bit for bit instead of drifting
apart by rounding over hundreds of swaps.

A period whose update was **not** included in Ā_j (dropped, rejected, late) cannot be
swapped out: the site applies Ā_j − 0 and keeps its A_{n,j}, which it re-sends inside its
next update (``carry``). The invariant then holds with that next update counted in full,
and no site's work is lost to a bad link.

Without compensation (the ablation) the site trains from the stale global model x_v
alone, forgetting its own recent periods: plain delayed SGD.

Momentum: the site's optimiser (momentum included) restarts at every period, as in
local-SGD averaging, so A_{n,r} is exactly the net change the site made to its model and
the swap leaves no residue; weight decay enters A_{n,r} the same way. With D = 0 this is
local-SGD averaging exactly; with D = 0 and p = 1, synchronous SGD.

No Flower and no torch: arrays are name → numpy array, in float64 where the sums are.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from flplatform.core.checks import require
from flplatform.core.errors import ConfigError
from strategies.knobs import delay_problem
from strategies.layout import carried, difference

Arrays = dict[str, np.ndarray]


def _add(total: Arrays | None, update: Mapping[str, np.ndarray]) -> Arrays:
    """total + update in float64, array by array; either may hold only some of the model's
    arrays (streaming sync sends one fragment)."""
    out = dict(total or {})
    for k, v in update.items():
        out[k] = np.array(v, dtype=np.float64) if k not in out else out[k] + v
    return out


@dataclass
class SitePeriods:
    """What a site keeps between messages: its unsettled accumulated steps and its carry.

    ``pending`` maps a period r to A_{n,r} for every period whose average the site has
    not yet received; ``carry`` sums the steps of periods the server left out, to be
    re-sent with the next update (streaming sync: with the next update of their arrays'
    fragment, and the change to the arrays a period did not send). At most D + 1 pending
    vectors exist at a time.
    """

    pending: dict[int, Arrays] = field(default_factory=dict)
    carry: Arrays | None = None

    def settle(self, version: int, included: Collection[int]) -> list[int]:
        """The site received x_version: drop what it holds, carry what it lacks.

        ``included``: this site's periods ≤ ``version`` whose update is in the average.
        Returns the periods that were left out (their steps are now in ``carry``).
        """
        left_out = []
        for period in sorted(p for p in self.pending if p <= version):
            update = self.pending.pop(period)
            if period not in included:
                self.carry = _add(self.carry, update)
                left_out.append(period)
        return left_out

    def retry(self, period: int) -> None:
        """The site is asked for ``period`` again: its kept step for it goes to ``carry``."""
        update = self.pending.pop(period, None)
        if update is not None:
            self.carry = _add(self.carry, update)

    def local_model(
        self, global_model: Mapping[str, np.ndarray], *, compensate: bool, partial: bool = False
    ) -> Arrays:
        """x_local = x_v + Σ pending A_j + carry, summed in float64 and rounded to each
        array's dtype (new arrays); x_v's own arrays without compensation. ``partial``
        (streaming sync): a kept step may hold only some of the model's arrays.

        The float64 sum runs over blocks of ``SUM_BLOCK`` coordinates, so no float64 copy
        of the model exists; each coordinate is summed in the same order as a whole-array
        sum would, so the result is the same to the bit.
        """
        if not compensate:
            return dict(global_model)
        updates = [*self.pending.values(), *([self.carry] if self.carry else [])]
        for update in updates:
            names = set(update)
            fits = names == set(global_model) or (partial and names <= set(global_model))
            if not fits or any(np.shape(v) != np.shape(global_model[k]) for k, v in update.items()):
                raise ConfigError(
                    "the site's kept updates do not fit the model the server sent "
                    "(was the model changed mid-run?); restart the site to clear its state"
                )
        return {
            k: sum_in_float64(
                [v, *(update[k] for update in updates if k in update)], np.asarray(v).dtype
            )
            for k, v in global_model.items()
        }

    def record(
        self,
        period: int,
        start: Mapping[str, np.ndarray],
        trained: Mapping[str, np.ndarray],
        *,
        compensate: bool,
        fragment: Collection[str] | None = None,
    ) -> Arrays:
        """A_{n,period} = (trained − start) + carry, rounded to the model's dtypes: what is
        sent (the float64 difference rounded, ``strategies.layout.difference``).

        Compensating, it is also kept (exactly as sent, so the site's model is the sum
        of what the server knows) until its average arrives.

        ``fragment`` (streaming sync, compensating): only these arrays are sent and kept;
        the others' change stays in the carry, in float64, until their fragment's period.
        """
        if compensate and (self.carry is not None or fragment is not None):
            carry = self.carry or {}
            sent, kept = {}, {}
            for k in start:
                terms = [trained[k], start[k], *([carry[k]] if k in carry else [])]
                signs = (1, -1, 1)[: len(terms)]
                if fragment is None or k in fragment:
                    sent[k] = sum_in_float64(terms, start[k].dtype, signs=signs)
                else:
                    kept[k] = sum_in_float64(terms, np.dtype(np.float64), signs=signs)
            self.carry = kept or None
        else:
            sent = difference(trained, start)
        if compensate:
            self.pending[period] = sent  # in the model's dtypes: the same values as sent
        return sent


SUM_BLOCK = 1 << 16  # coordinates summed in float64 at a time


def sum_in_float64(
    terms: list[np.ndarray], dtype: np.dtype, *, signs: tuple[int, ...] | None = None
) -> np.ndarray:
    """Σ ±terms, added left to right in float64 and rounded once to ``dtype`` (a new
    array; integer dtypes truncate, as ``astype`` does). ``signs``: +1 or −1 per term
    (all +1 by default); the first term's sign must be +1.

    Block by block, so the float64 temporaries stay small and in cache.
    """
    first = np.asarray(terms[0])
    out = np.empty(first.shape, dtype=dtype)
    flat_out = out.reshape(-1)
    flats = [np.asarray(t).reshape(-1) for t in terms]
    n = flat_out.size
    total = np.empty(min(n, SUM_BLOCK))  # float64 (block,)
    for begin in range(0, n, SUM_BLOCK):
        end = min(begin + SUM_BLOCK, n)
        acc = total[: end - begin]
        acc[...] = flats[0][begin:end]
        for flat, sign in zip(flats[1:], (signs or (1,) * len(flats))[1:], strict=True):
            if sign < 0:
                acc -= flat[begin:end]
            else:
                acc += flat[begin:end]
        if dtype.kind == "f":
            flat_out[begin:end] = acc
        else:  # integer and bool arrays: as astype from float64, no bool or unsigned wrap
            flat_out[begin:end] = carried(acc, dtype)
    return out


@dataclass
class ServerPeriods:
    """The server's side: which period each site is on, and which of its updates counted.

    A site may start period q once the global model of version q − 1 − D exists; it is
    sent exactly that version (the average arrives D rounds late). ``unsettled`` holds
    each site's periods whose fate it has not yet been told; the site is told with its
    next message and they are forgotten once it replies to that message.
    """

    delay: int
    next_period: dict[int, int] = field(default_factory=dict)
    unsettled: dict[int, set[int]] = field(default_factory=dict)
    included: dict[int, set[int]] = field(default_factory=dict)
    awaited: dict[int, int] = field(default_factory=dict)  # site → period sent, no reply seen

    def __post_init__(self) -> None:
        require(delay_problem(self.delay))

    def period_for(self, site: int, *, open_round: int, last_round: int) -> int | None:
        """The period ``site`` (idle now) may start while ``open_round`` is open, or None.

        A site that joined late starts at the open round. A site idle while a reply is
        still awaited never computed that period (it sat it out, failed, or its message
        was lost): it is offered the same period again while that round is open.
        """
        lost = self.awaited.pop(site, None)
        if lost is not None:
            self.next_period[site] = lost
        period = max(self.next_period.get(site, 1), open_round)
        if period > last_round or period - 1 - self.delay > open_round - 1:
            return None
        return period

    def version_for(self, period: int) -> int:
        """The global model version a site starting ``period`` is sent: D rounds old."""
        return max(0, period - 1 - self.delay)

    def sent(self, site: int, period: int) -> None:
        """``site`` was given ``period``."""
        self.next_period[site] = period + 1
        self.unsettled.setdefault(site, set()).add(period)
        self.awaited[site] = period

    def answered(self, site: int) -> int | None:
        """``site`` replied to its message: return the period it was asked for (or None)."""
        return self.awaited.pop(site, None)

    def counted(self, site: int, period: int) -> None:
        """``site``'s update for ``period`` is in Ā_period."""
        self.included.setdefault(site, set()).add(period)

    def news_for(self, site: int, version: int) -> list[int]:
        """The site's periods ≤ ``version`` included in the averages (what it may swap)."""
        return sorted(
            p
            for p in self.unsettled.get(site, set())
            if p <= version and p in self.included.get(site, set())
        )

    def acknowledged(self, site: int, version: int) -> None:
        """The site replied to a message carrying x_version: it has settled up to there."""
        kept = {p for p in self.unsettled.get(site, set()) if p > version}
        self.unsettled[site] = kept
        self.included[site] = {p for p in self.included.get(site, set()) if p > version}

    def forget(self, site: int, *, keep: int) -> None:
        """``site`` lost its kept steps (a restart): forget its periods before ``keep``.

        Their steps are gone at the site, so there is nothing left to swap for them; an
        average that includes one still stands.
        """
        self.unsettled[site] = {p for p in self.unsettled.get(site, set()) if p >= keep}
        self.included[site] = {p for p in self.included.get(site, set()) if p >= keep}
