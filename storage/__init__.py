"""The ledger: every run, round, site update and evaluation, in any SQLAlchemy database.

``LedgerRepository`` is the only way the platform touches the database; it returns the frozen
records defined in ``storage.records``. This package imports neither Flower nor torch:
strategies and the engine receive a repository (or something shaped like it) and never import
``storage`` themselves.
"""

from .records import (
    EVALUATION_DROPPED,
    EVALUATION_EVALUATED,
    EVALUATION_STATUSES,
    RUN_FAILED,
    RUN_FINISHED,
    RUN_RUNNING,
    RUN_STATUSES,
    UPDATE_APPLIED,
    UPDATE_BUFFERED,
    UPDATE_CANCELLED,
    UPDATE_DROPPED,
    UPDATE_REJECTED,
    UPDATE_STATUSES,
    EvaluationInput,
    EvaluationRecord,
    EvaluationStatus,
    FinalRunStatus,
    RoundRecord,
    RunRecord,
    RunStatus,
    SiteRecord,
    SiteSummary,
    UpdateInput,
    UpdateRecord,
    UpdateStatus,
)
from .repository import LedgerRepository
from .session import (
    FLPLATFORM_HOME_ENV,
    LEDGER_FILENAME,
    default_db_url,
    flplatform_home,
    mask_db_url,
    normalize_db_url,
)

__all__ = [
    "EVALUATION_DROPPED",
    "EVALUATION_EVALUATED",
    "EVALUATION_STATUSES",
    "FLPLATFORM_HOME_ENV",
    "LEDGER_FILENAME",
    "RUN_FAILED",
    "RUN_FINISHED",
    "RUN_RUNNING",
    "RUN_STATUSES",
    "UPDATE_APPLIED",
    "UPDATE_BUFFERED",
    "UPDATE_CANCELLED",
    "UPDATE_DROPPED",
    "UPDATE_REJECTED",
    "UPDATE_STATUSES",
    "EvaluationInput",
    "EvaluationRecord",
    "EvaluationStatus",
    "FinalRunStatus",
    "LedgerRepository",
    "RoundRecord",
    "RunRecord",
    "RunStatus",
    "SiteRecord",
    "SiteSummary",
    "UpdateInput",
    "UpdateRecord",
    "UpdateStatus",
    "default_db_url",
    "flplatform_home",
    "mask_db_url",
    "normalize_db_url",
]
