"""The ledger: every run, round, site update, evaluation and byte, in any SQLAlchemy database.

``LedgerRepository`` is the only way the platform touches the database; it takes the rows
declared in ``flplatform.core.ledger_rows`` and returns the frozen records of ``storage.records``.
This package imports neither Flower nor torch, and the engine never imports it: it writes
through a ``LedgerSink`` (``flplatform.run.ledger.SqlLedger`` adapts this repository).

Modules: ``repository`` (the repository), ``records`` (what it takes and returns),
``validators`` (every check on what it takes), ``mapping`` (rows in, records out),
``summaries`` (per-run and per-site totals), ``models`` (the SQL tables; 0005 added the
checkpoints and events of runs, 0006 the traffic no update or evaluation row holds),
``migrations`` (their history), ``session`` (URLs, engines and transactions).
"""

from flplatform.core.ledger_rows import (
    EVALUATION_DROPPED,
    EVALUATION_EVALUATED,
    EVALUATION_STATUSES,
    RUN_FAILED,
    RUN_FINISHED,
    RUN_RUNNING,
    RUN_STATUSES,
    TRAFFIC_EVALUATE,
    TRAFFIC_KINDS,
    TRAFFIC_QUERY,
    TRAFFIC_TRAIN,
    UPDATE_APPLIED,
    UPDATE_BUFFERED,
    UPDATE_CANCELLED,
    UPDATE_DROPPED,
    UPDATE_REJECTED,
    UPDATE_STATUSES,
    EvaluationStatus,
    FinalRunStatus,
    RunStatus,
    TrafficKind,
    UpdateStatus,
)

from .migrations import SchemaUpgrade
from .records import (
    CLOCK_VIRTUAL,
    CLOCK_WALL,
    CheckpointInput,
    CheckpointRecord,
    EvaluationInput,
    EvaluationRecord,
    RoundRecord,
    RunEventRecord,
    RunRecord,
    SiteRecord,
    SiteSummary,
    TrafficInput,
    TrafficRecord,
    UpdateInput,
    UpdateRecord,
    WaitingClock,
)
from .repository import LedgerRepository
from .session import (
    FLPLATFORM_HOME_ENV,
    LEDGER_FILENAME,
    default_db_url,
    flplatform_home,
    ledger_id,
    mask_db_url,
    normalize_db_url,
)

__all__ = [
    "CLOCK_VIRTUAL",
    "CLOCK_WALL",
    "EVALUATION_DROPPED",
    "EVALUATION_EVALUATED",
    "EVALUATION_STATUSES",
    "FLPLATFORM_HOME_ENV",
    "LEDGER_FILENAME",
    "RUN_FAILED",
    "RUN_FINISHED",
    "RUN_RUNNING",
    "RUN_STATUSES",
    "TRAFFIC_EVALUATE",
    "TRAFFIC_KINDS",
    "TRAFFIC_QUERY",
    "TRAFFIC_TRAIN",
    "UPDATE_APPLIED",
    "UPDATE_BUFFERED",
    "UPDATE_CANCELLED",
    "UPDATE_DROPPED",
    "UPDATE_REJECTED",
    "UPDATE_STATUSES",
    "CheckpointInput",
    "CheckpointRecord",
    "EvaluationInput",
    "EvaluationRecord",
    "EvaluationStatus",
    "FinalRunStatus",
    "LedgerRepository",
    "RoundRecord",
    "RunEventRecord",
    "RunRecord",
    "RunStatus",
    "SchemaUpgrade",
    "SiteRecord",
    "SiteSummary",
    "TrafficInput",
    "TrafficKind",
    "TrafficRecord",
    "UpdateInput",
    "UpdateRecord",
    "UpdateStatus",
    "WaitingClock",
    "default_db_url",
    "flplatform_home",
    "ledger_id",
    "mask_db_url",
    "normalize_db_url",
]
