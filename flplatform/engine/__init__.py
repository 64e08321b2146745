"""The round engine: dispatch, pull, order by clock, account for every byte."""

from flplatform.engine.clock import Clock, Landing, Schedule, VirtualClock, WallClock
from flplatform.engine.engine import (
    Contribution,
    EngineStrategy,
    RoundEngine,
    SubsetGrid,
)
from flplatform.engine.events import (
    APPLIED,
    BUFFERED,
    CANCELLED,
    DROPPED,
    EVALUATED,
    REJECTED,
    Dispatch,
    EvaluationOutcome,
    LedgerSink,
    NullLedger,
    RoundSummary,
    SiteInfo,
    UpdateOutcome,
)
from flplatform.engine.policy import AggregationPolicy, EngineView, Verdict
from flplatform.engine.synchrony import SYNC_MODES, PeriodSync, Synchrony

__all__ = [
    "APPLIED",
    "BUFFERED",
    "CANCELLED",
    "DROPPED",
    "EVALUATED",
    "REJECTED",
    "AggregationPolicy",
    "Clock",
    "Contribution",
    "Dispatch",
    "EngineStrategy",
    "EngineView",
    "EvaluationOutcome",
    "LedgerSink",
    "NullLedger",
    "RoundEngine",
    "RoundSummary",
    "SiteInfo",
    "SubsetGrid",
    "PeriodSync",
    "Synchrony",
    "SYNC_MODES",
    "Schedule",
    "Landing",
    "VirtualClock",
    "UpdateOutcome",
    "Verdict",
    "WallClock",
]
