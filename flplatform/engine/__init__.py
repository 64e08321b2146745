"""The round engine: dispatch, pull, order by clock, account for every byte.

``engine`` holds the round loop; ``strategy`` what it asks of a strategy, ``policy`` what it
asks of a synchrony policy (``synchrony``: the modes); ``sites`` one state per site;
``mailbox`` the messages in flight; ``discovery`` new sites; ``rows`` and ``events`` the
ledger rows; ``evaluation`` federated evaluation; ``versions`` the model versions in use;
``stop_rule`` when a run that keeps failing stops; ``divergence`` when training diverges;
``clock`` wall or simulated time.

The package itself exports what a strategy and a policy are written against (the strategy
and policy protocols, the synchrony modes, the ledger's rows and sink), not the loop:
importing it for a strategy does not load the round loop, the mailbox or the guard
(``RoundEngine`` is in ``flplatform.engine.engine``, the clocks in ``clock``).
"""

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
from flplatform.engine.strategy import Contribution, EngineStrategy, SubsetGrid, Update, Work
from flplatform.engine.synchrony import SYNC_MODES, PeriodSync, Synchrony

__all__ = [
    "APPLIED",
    "BUFFERED",
    "CANCELLED",
    "DROPPED",
    "EVALUATED",
    "REJECTED",
    "AggregationPolicy",
    "Contribution",
    "Dispatch",
    "EngineStrategy",
    "EngineView",
    "EvaluationOutcome",
    "LedgerSink",
    "NullLedger",
    "RoundSummary",
    "SiteInfo",
    "SubsetGrid",
    "PeriodSync",
    "Synchrony",
    "SYNC_MODES",
    "UpdateOutcome",
    "Verdict",
    "Update",
    "Work",
]
