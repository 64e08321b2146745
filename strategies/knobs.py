"""Each strategy's knobs: one frozen dataclass per strategy, and the rules that check them.

Imports no Flower strategy code and no torch, so the command line and a run's configuration
check a strategy's knobs without loading either (``flplatform.app.config_rules``). A
strategy's constructor takes the same names as keyword arguments (Flower's convention) with
its defaults, builds its knobs object and refuses it with every problem at once; the
configuration builds the same object, so each rule is written once, here.

The dataclasses have no defaults on purpose: the constructor's signature says a strategy's
defaults, ``flplatform.app.config.RunConfig`` the command line's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flplatform.core.checks import (
    Problem,
    SyncOnly,
    integer,
    is_integer,
    number,
    odd,
    one_of,
    positive,
    unit_interval,
)
from flplatform.core.errors import ConfigError
from strategies.averaged_arrays import names_problem
from strategies.codecs import make_codec  # the one parser of a spec (no torch

MEAN, MEDIAN, TRIMMED_MEAN, CENTERED_CLIP = "mean", "median", "trimmed-mean", "centered-clip"
# local-SGD averaging's ways to combine updates
AGGREGATORS = (MEAN, MEDIAN, TRIMMED_MEAN, CENTERED_CLIP)
REMOVALS = ("zero", "subtract")  # how FetchSGD's applied step leaves its error sketch

DELAYED_SYNC_ONLY = SyncOnly(
    "strategy 'delayed'",
    "every site's period-r update forms the round-r average and fast sites run up to delay "
    "rounds ahead instead of waiting; dropping or cancelling stragglers (k-sync, async "
    "modes) would take updates out of the swap",
)


def sketched_sync_only(site_algorithm: str) -> SyncOnly:
    """The synchrony modes a sketched strategy runs with."""
    return SyncOnly(
        f"strategy '{site_algorithm}'",
        "each step merges the sketches of the sites it synced, and a stale sketch would be of "
        "another model; sample sites with fraction-train instead",
    )


# ------------------------------------------------------------- one knob, for every strategy
def eta_problem(eta: object) -> Problem:
    """What is wrong with a server learning rate η (``server-lr``), the same for every strategy."""
    return positive(eta, "server-lr", says="> 0 (the server learning rate η)")


def delay_problem(delay: object) -> Problem:
    """What is wrong with a delay D (``delay``): rounds until a period's average arrives."""
    return integer(delay, "delay", minimum=0, says="an integer >= 0 rounds")


def k_problem(k: object) -> Problem:
    """What is wrong with k, the coordinates a sketched strategy applies per step."""
    return integer(
        k,
        "k",
        minimum=1,
        says="an integer >= 1: the coordinates applied per step (about 1% of the model's "
        "parameters is typical)",
    )


def feedback_problems(*, rho: object, eta: object, removal: object) -> list[Problem]:
    """Every problem with FetchSGD's server step: ρ (``sketch-momentum``), η and the removal."""
    return [
        unit_interval(rho, "sketch-momentum", says="in [0, 1) (FetchSGD's sketch momentum ρ)"),
        eta_problem(eta),
        one_of(removal, "sketch-removal", REMOVALS),
    ]


def sampling_problems(*, fraction_train: object, fraction_evaluate: object) -> list[Problem]:
    """Every problem with the fractions of sites sampled to train and to evaluate."""
    return [
        number(fraction_train, "fraction-train", above=0.0, at_most=1.0),
        number(fraction_evaluate, "fraction-evaluate", at_least=0.0, at_most=1.0),
    ]


def codec_problem(codec: object) -> Problem:
    """What is wrong with an upload codec spec (``none``, ``int8``, ``int4``, ``topk:<k or
    fraction>``)."""
    try:
        make_codec(codec)  # type: ignore[arg-type]
    except ConfigError as exc:
        return exc.reason
    return None


def momentum_problems(beta: object, nesterov: bool) -> list[Problem]:
    """What is wrong with a server (outer) momentum β and its Nesterov flag."""
    return [
        unit_interval(beta, "server-momentum", says="in [0, 1) (the server momentum β)"),
        (
            "server-nesterov needs server-momentum > 0 (Nesterov momentum looks one "
            "velocity ahead; with β = 0 there is none)"
            if nesterov and beta == 0.0
            else None
        ),
    ]


def sample_size(fraction: float, num_sites: int) -> int:
    """How many of ``num_sites`` a round's sample of ``fraction`` asks (at least one)."""
    return max(1, int(round(fraction * num_sites)))


def _least_trim(updates: int) -> str:
    """The advice on the smallest trim-fraction that cuts one of ``updates`` at each end."""
    least = math.ceil(1000 / updates) / 1000  # int(least · updates) ≥ 1, and typeable
    return f"raise trim-fraction to at least {least:g}, " if least < 0.5 else ""


def robust_aggregation_problem(aggregator: str, trim_fraction: float, most_updates: int) -> Problem:
    """A median or trimmed mean over rounds too small to be robust: the plain mean in effect.

    ``most_updates`` is the most updates a round combines (the sample in sync mode, K in
    the K modes, 1 in async). The coordinate-wise median of two updates is their mean (of
    one, the update itself); a trimmed mean cuts int(trim-fraction × n) values at each end,
    none below 1/trim-fraction updates (Flower's maths). Either way one hostile site moves
    the round as far as with the mean, while the user believes it outvoted.
    """
    rounds = (
        "a round combines one update"
        if most_updates == 1
        else f"a round combines at most {most_updates} updates"
    )
    if aggregator == MEDIAN and most_updates < 3:
        median_is = "the update itself" if most_updates == 1 else "their mean"
        return (
            f"aggregator 'median': {rounds}, whose median is {median_is}, so no site is "
            "outvoted; use at least 3 updates a round (more sites, fraction-train or k), or "
            "aggregator 'centered-clip', which bounds each update in any mode"
        )
    if aggregator == TRIMMED_MEAN and trim_fraction > 0 and int(trim_fraction * most_updates) < 1:
        return (
            f"aggregator 'trimmed-mean' with trim-fraction {trim_fraction:g}: {rounds} and "
            f"cuts int({trim_fraction:g} x {most_updates}) = 0 of them at each end: the plain "
            f"mean; {_least_trim(most_updates)}use more updates a round, or aggregator "
            "'centered-clip'"
        )
    return None


# ------------------------------------------------------------------ one object per strategy
@dataclass(frozen=True)
class LocalSGDKnobs:
    """``LocalSGDAveraging``'s knobs (FedAvg, FedAvgM, DiLoCo; mean, median, trimmed mean,
    centred clipping)."""

    eta: float
    beta: float
    nesterov: bool
    momentum_every: int
    fraction_train: float
    fraction_evaluate: float
    codec: str
    aggregator: str
    trim_fraction: float
    clip_radius: float
    averaged_arrays: Sequence[str]

    def problems(self) -> list[Problem]:
        """Every problem with these knobs (``None`` entries: no problem)."""
        return [
            names_problem(self.averaged_arrays),
            eta_problem(self.eta),
            *momentum_problems(self.beta, self.nesterov),
            integer(self.momentum_every, "server-momentum-every", minimum=1),
            (
                "server-momentum-every > 1 is delayed Nesterov: set server-nesterov true"
                if is_integer(self.momentum_every)
                and int(self.momentum_every) > 1
                and not self.nesterov
                else None
            ),
            *sampling_problems(
                fraction_train=self.fraction_train, fraction_evaluate=self.fraction_evaluate
            ),
            codec_problem(self.codec),
            one_of(self.aggregator, "aggregator", AGGREGATORS),
            number(self.trim_fraction, "trim-fraction", at_least=0.0, below=0.5),
            number(
                self.clip_radius,
                "clip-radius",
                above=0.0,
                says="a number > 0 (centered-clip's radius, in median recent distances)",
            ),
        ]


@dataclass(frozen=True)
class DelayedKnobs:
    """``DelayedCompensated``'s knobs (DTS, DGA)."""

    delay: int
    num_rounds: int
    compensate: bool
    eta: float
    beta: float
    nesterov: bool
    fragments: int
    fraction_evaluate: float
    codec: str
    averaged_arrays: Sequence[str]

    def problems(self) -> list[Problem]:
        """Every problem with these knobs (``None`` entries: no problem)."""
        return [
            names_problem(self.averaged_arrays),
            delay_problem(self.delay),
            integer(self.num_rounds, "num-rounds", minimum=1),
            eta_problem(self.eta),
            *momentum_problems(self.beta, self.nesterov),
            integer(
                self.fragments,
                "fragments",
                minimum=1,
                says=">= 1 (streaming sync's fragments; 1: the whole model every round)",
            ),
            (
                "fragments > 1 needs compensation: the arrays a period does not sync wait in "
                "the site's carry, which plain delayed SGD does not keep"
                if is_integer(self.fragments) and int(self.fragments) > 1 and not self.compensate
                else None
            ),
            *sampling_problems(fraction_train=1.0, fraction_evaluate=self.fraction_evaluate),
            codec_problem(self.codec),
        ]


@dataclass(frozen=True)
class SketchKnobs:
    """What both sketched strategies share: k, the sketch's shape and the sampling."""

    k: int
    sketch_rows: int
    sketch_cols: int
    fraction_train: float
    fraction_evaluate: float
    averaged_arrays: Sequence[str]

    def problems(self) -> list[Problem]:
        """Every problem with these knobs (``None`` entries: no problem)."""
        return [
            names_problem(self.averaged_arrays),
            k_problem(self.k),
            odd(self.sketch_rows, "sketch-rows"),
            integer(self.sketch_cols, "sketch-cols", minimum=0, says=">= 0 (0: 5·k)"),
            *sampling_problems(
                fraction_train=self.fraction_train, fraction_evaluate=self.fraction_evaluate
            ),
        ]


@dataclass(frozen=True)
class FetchSGDKnobs(SketchKnobs):
    """``FetchSGD``'s knobs: the sketch's, and its server step's ρ, η and removal."""

    rho: float
    eta: float
    removal: str

    def problems(self) -> list[Problem]:
        """Every problem with these knobs (``None`` entries: no problem)."""
        return [
            *super().problems(),
            *feedback_problems(rho=self.rho, eta=self.eta, removal=self.removal),
        ]


@dataclass(frozen=True)
class SketchedSGDKnobs(SketchKnobs):
    """``SketchedSGD``'s knobs: the sketch's, P, the sites' momentum m and η."""

    candidate_factor: int
    momentum: float
    eta: float

    def problems(self) -> list[Problem]:
        """Every problem with these knobs (``None`` entries: no problem)."""
        return [
            *super().problems(),
            integer(
                self.candidate_factor,
                "candidate-factor P",
                minimum=1,
                says=">= 1 (the values round asks for P·k coordinates)",
            ),
            unit_interval(
                self.momentum, "step-momentum", says="in [0, 1) (Sketched-SGD's momentum m)"
            ),
            eta_problem(self.eta),
        ]


StrategyKnobs = LocalSGDKnobs | DelayedKnobs | FetchSGDKnobs | SketchedSGDKnobs
