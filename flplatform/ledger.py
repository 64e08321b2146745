"""The engine's ``LedgerSink`` backed by the SQL repository of ``storage``.

The only module that imports both the engine and ``storage``. The engine's outcomes are the
ledger's rows (``flplatform.ledger_rows``); here they become storage's validated inputs.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from flplatform.engine.events import RoundSummary, SiteInfo
from storage import EvaluationInput, LedgerRepository, UpdateInput


class SqlLedger:
    """Write sites and rounds of one run, each round in its own transaction."""

    def __init__(self, repository: LedgerRepository, run_id: int) -> None:
        self.repository = repository
        self.run_id = run_id

    def add_site(self, site: SiteInfo, profile: dict[str, Any]) -> None:
        """Record a site that joined the run."""
        self.repository.add_site(
            self.run_id,
            name=site.name,
            node_id=site.node_id,
            partition_id=site.partition_id,
            num_examples=site.num_examples,
            profile=profile,
        )

    def record_round(self, summary: RoundSummary) -> None:
        """Record one finished round with all its updates and evaluations."""
        self.repository.record_round(
            self.run_id,
            round=summary.server_round,
            model_version=summary.model_version,
            started_at=summary.started_at,
            finished_at=summary.finished_at,
            metrics=summary.metrics,
            train_loss=summary.train_loss,
            virtual_started_at=summary.virtual_started_at,
            virtual_finished_at=summary.virtual_finished_at,
            updates=[UpdateInput(**asdict(u)) for u in summary.updates],
            evaluations=[EvaluationInput(**asdict(e)) for e in summary.evaluations],
            run_warning=summary.warning,
        )
