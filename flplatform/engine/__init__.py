"""The round engine: dispatch, pull, order by clock, account for every byte."""

from flplatform.engine.clock import Clock, WallClock
from flplatform.engine.engine import Contribution, EngineStrategy, RoundEngine, SubsetGrid
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
from flplatform.engine.policy import AggregationPolicy, EngineView, SyncPolicy, Verdict

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
    "SyncPolicy",
    "UpdateOutcome",
    "Verdict",
    "WallClock",
]
