"""Run one federation on a Grid: the body of the ServerApp, as a library function."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from clients.models import build_model
from clients.site import TestSet, load_test_set
from clients.training import evaluate, pick_device
from flplatform import keys
from flplatform.config import DELAYED, FETCHSGD, SKETCHED_SGD, RunConfig
from flplatform.engine import (
    Clock,
    PeriodSync,
    RoundEngine,
    RoundSummary,
    Synchrony,
    VirtualClock,
    WallClock,
)
from flplatform.errors import FLPlatformError
from flplatform.ledger import SqlLedger
from storage import LedgerRepository
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.local_sgd import LocalSGDAveraging
from strategies.sketched_sgd import SketchedSGD

log = logging.getLogger("flplatform")


def build_strategy(
    config: RunConfig,
) -> LocalSGDAveraging | DelayedCompensated | FetchSGD | SketchedSGD:
    """The strategy named in ``config``, with its knobs (RunConfig validated them)."""
    if config.strategy == SKETCHED_SGD:
        return SketchedSGD(
            k=config.k,
            sketch_rows=config.sketch_rows,
            sketch_cols=config.sketch_cols,
            candidate_factor=config.candidate_factor,
            momentum=config.server_momentum,
            eta=config.server_lr,
            fraction_train=config.fraction_train,
            fraction_evaluate=config.fraction_evaluate,
            seed=config.seed,
        )
    if config.strategy == FETCHSGD:
        return FetchSGD(
            k=config.k,
            sketch_rows=config.sketch_rows,
            sketch_cols=config.sketch_cols,
            rho=config.server_momentum,
            eta=config.server_lr,
            removal=config.sketch_removal,
            fraction_train=config.fraction_train,
            fraction_evaluate=config.fraction_evaluate,
            seed=config.seed,
        )
    if config.strategy == DELAYED:
        return DelayedCompensated(
            delay=config.delay,
            num_rounds=config.num_server_rounds,
            compensate=config.compensation,
            eta=config.server_lr,
            fraction_evaluate=config.fraction_evaluate,
            seed=config.seed,
        )
    return LocalSGDAveraging(
        eta=config.server_lr,
        beta=config.server_momentum,
        fraction_train=config.fraction_train,
        fraction_evaluate=config.fraction_evaluate,
        seed=config.seed,
        codec=config.codec,
    )


def build_policy(config: RunConfig) -> Synchrony | PeriodSync:
    """The synchrony mode named in ``config``, with its options.

    Delayed updates run ``sync`` pipelined: sites work ahead of the last average.
    """
    if config.strategy == DELAYED:
        return PeriodSync()
    return Synchrony(
        config.sync,
        k=config.k,
        staleness_bound=None if config.staleness_bound < 0 else config.staleness_bound,
        weighting=config.staleness_weighting or None,
        step_c=config.staleness_step_c,
        adasync=config.adasync,
        concurrency=config.concurrency,
        seed=config.seed,
    )


def build_clock(config: RunConfig) -> Clock:
    """A virtual clock over the configured network, or the wall clock without one."""
    network = config.load_network()
    return WallClock() if network is None else VirtualClock(network, seed=config.seed)


def train_config_for(config: RunConfig) -> ConfigRecord:
    """What every site is told each round (Flower's ``config`` record)."""
    return ConfigRecord(
        {
            keys.LR: config.lr,
            keys.MOMENTUM: config.momentum,
            # delayed updates: one message per period of p local steps
            keys.LOCAL_STEPS: config.period or config.local_steps,
            keys.LOCAL_EPOCHS: config.local_epochs,
            keys.BATCH_SIZE: config.batch_size,
            keys.SEED: config.seed,
        }
    )


def central_evaluator(
    test: TestSet, *, model_name: str, seed: int
) -> Callable[[int, ArrayRecord], MetricRecord]:
    """Evaluate the global model on the held-out test set after every round."""
    device = pick_device()
    model = build_model(
        model_name, input_shape=test.input_shape, num_classes=test.num_classes, seed=seed
    )

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = evaluate(model, test.x, test.y, device=device)
        return MetricRecord({keys.ACCURACY: accuracy, keys.LOSS: loss})

    return evaluate_fn


def run_federation(grid: Grid, config: RunConfig) -> Result:
    """Train ``config.num_server_rounds`` rounds over ``grid``, recording every round.

    The run row is written first and each round is committed as it finishes; if this
    process dies the run stays "running" with every finished round readable.
    """
    repository = LedgerRepository.open(config.db or None)
    run_id = repository.create_run(
        name=f"{config.strategy}-{config.dataset}",
        strategy=config.strategy,
        seed=config.seed,
        config=dict(config.to_run_config()),
        num_rounds_planned=config.num_server_rounds,
        tag=config.run_tag or None,
        network=config.network or None,
    )
    log.info("ledger: run %s in %s", run_id, repository.url)
    engine: RoundEngine | None = None
    try:
        test = load_test_set(dataset=config.dataset, partition=config.partition, seed=config.seed)
        model = build_model(
            config.model,
            input_shape=test.input_shape,
            num_classes=test.num_classes,
            seed=config.seed,
        )
        engine = RoundEngine(
            grid,
            build_strategy(config),
            policy=build_policy(config),
            clock=build_clock(config),
            ledger=SqlLedger(repository, run_id),
            round_timeout=config.round_timeout,
            required_sites=config.required_sites,
            on_round=_log_round,
        )
        result = engine.run(
            ArrayRecord(model.state_dict()),
            num_rounds=config.num_server_rounds,
            train_config=train_config_for(config),
            evaluate_fn=central_evaluator(test, model_name=config.model, seed=config.seed),
            federated_evaluation=config.fraction_evaluate > 0,
        )
    except BaseException as exc:
        reason = exc.reason if isinstance(exc, FLPlatformError) else f"{type(exc).__name__}: {exc}"
        repository.finish_run(
            run_id,
            status="failed",
            error=reason,
            finished_at=time.time(),
            simulated_seconds=engine.simulated_seconds if engine else None,
        )
        repository.close()
        raise
    final = result.evaluate_metrics_serverapp.get(config.num_server_rounds)
    repository.finish_run(
        run_id,
        status="finished",
        final_metrics={k: float(v) for k, v in final.items() if isinstance(v, int | float)}
        if final
        else None,
        finished_at=time.time(),
        simulated_seconds=engine.simulated_seconds,
    )
    repository.close()
    return result


def _log_round(summary: RoundSummary) -> None:
    metrics = " ".join(f"{k}={v:.4f}" for k, v in summary.metrics.items())
    simulated = (
        f", simulated t={summary.virtual_finished_at:.2f} s"
        if summary.virtual_finished_at is not None
        else ""
    )
    log.info(
        "round %d: version %d, %d updates, %d B up, %d B down%s, %s",
        summary.server_round,
        summary.model_version,
        len(summary.updates),
        summary.bytes_up,
        summary.bytes_down,
        simulated,
        metrics,
    )
