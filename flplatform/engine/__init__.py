"""The round engine: dispatch, pull, order by clock, account for every byte.

``engine`` holds the round loop; ``strategy`` what it asks of a strategy, ``policy`` what it
asks of a synchrony policy (``synchrony``: the modes); ``sites`` one state per site;
``mailbox`` the messages in flight; ``discovery`` new sites; ``rows`` and ``events`` the
ledger rows; ``evaluation`` federated evaluation; ``versions`` the model versions in use;
``stop_rule`` when a run that keeps failing stops; ``divergence`` when training diverges;
``clock`` wall or simulated time.
"""

from flplatform.engine.clock import Clock, Landing, Schedule, VirtualClock, WallClock
from flplatform.engine.engine import RoundEngine
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
from flplatform.engine.guard import GuardOptions, UpdateGuard
from flplatform.engine.policy import AggregationPolicy, EngineView, Verdict
from flplatform.engine.strategy import Contribution, EngineStrategy, SubsetGrid, Update, Work
from flplatform.engine.synchrony import SYNC_MODES, PeriodSync, Synchrony, SyncOnly

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
    "GuardOptions",
    "LedgerSink",
    "NullLedger",
    "RoundEngine",
    "RoundSummary",
    "SiteInfo",
    "SubsetGrid",
    "PeriodSync",
    "Synchrony",
    "SYNC_MODES",
    "SyncOnly",
    "Schedule",
    "Landing",
    "VirtualClock",
    "UpdateGuard",
    "UpdateOutcome",
    "Verdict",
    "WallClock",
    "Update",
    "Work",
]
