"""Run federations on a Grid: the body of the ServerApp, as library functions.

:func:`run_federation` runs one; :func:`run_members` runs a sweep's members one after
another on the same Grid (``flplatform.app.sweep``), each sending its sites the data and model
keys and its own app keys where the sites' run config says otherwise (``site_config``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from clients.models import build_model
from clients.site import SiteDataConfig, TestSet, load_test_set
from clients.training import evaluate, pick_device
from flplatform.app.config import RunConfig
from flplatform.app.config_rules import strategy_knobs
from flplatform.core import keys
from flplatform.core.errors import ConfigError, FLPlatformError
from flplatform.engine import AggregationPolicy
from flplatform.engine.link import run_watched, superlink_watch, watch_superlink
from flplatform.engine.mailbox import PULL_CHUNK, TTL_GRACE_SECONDS
from flplatform.engine.strategy import ForwardingGrid
from flplatform.run.options import ConfigValue, PlatformOptions
from flplatform.run.parts import choose_policy
from flplatform.run.run_record import record_failed_start
from flplatform.run.start import start
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.knobs import DelayedKnobs, FetchSGDKnobs, LocalSGDKnobs, SketchedSGDKnobs
from strategies.local_sgd import LocalSGDAveraging
from strategies.sketched_sgd import SketchedSGD

log = logging.getLogger("flplatform")

# The run-config keys a site reads (``SiteDataConfig``): what a sweep member sends its
# sites where their own run config (the Flower run's) says otherwise.
SITE_KEYS = tuple(f.name.replace("_", "-") for f in fields(SiteDataConfig))


def build_strategy(
    config: RunConfig,
) -> LocalSGDAveraging | DelayedCompensated | FetchSGD | SketchedSGD:
    """The strategy named in ``config``, with its knobs (RunConfig validated them)."""
    knobs = strategy_knobs(config)
    strategy_class = {
        LocalSGDKnobs: LocalSGDAveraging,
        DelayedKnobs: DelayedCompensated,
        FetchSGDKnobs: FetchSGD,
        SketchedSGDKnobs: SketchedSGD,
    }[type(knobs)]
    return strategy_class(**asdict(knobs), seed=config.seed)


def platform_options(config: RunConfig) -> dict[str, Any]:
    """``flplatform.start``'s keyword arguments for ``config``: mode, network, ledger, ..."""
    return dict(
        num_rounds=config.num_server_rounds,
        timeout=config.round_timeout,
        sync=config.sync,
        k=config.sync_k,
        staleness_bound=None if config.staleness_bound < 0 else config.staleness_bound,
        staleness_weighting=config.staleness_weighting or None,
        staleness_step_c=config.staleness_step_c,
        adasync=config.adasync,
        concurrency=config.concurrency,
        network=config.network or None,
        compute_model=config.compute_model,
        step_seconds=config.step_seconds,
        seed=config.seed,
        ledger=config.db or "default",
        name=config.run_name,
        run_config=config.to_run_config(),
        tag=config.run_tag or None,
        required_sites=config.required_sites,
        max_failed_rounds=config.max_failed_rounds,
        update_norm_ratio=config.update_norm_ratio,
        update_norm_action=config.update_norm_action,
        max_site_share=config.max_site_share,
        reject_replays=config.reject_replays,
        update_min_cosine=config.update_min_cosine,
        checkpoint_every=config.checkpoint_every,
        keep_checkpoints=config.keep_checkpoints,
        checkpoint_dir=config.checkpoint_dir or None,
        resume_run=config.resume_run or None,
    )


def build_policy(config: RunConfig) -> AggregationPolicy:
    """The policy ``flplatform.start`` runs ``config``'s strategy under.

    Delayed updates run ``sync`` pipelined (``PeriodSync``): sites work ahead of the last
    average.
    """
    return choose_policy(build_strategy(config), PlatformOptions(**platform_options(config)))


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


def run_federation(
    grid: Grid, config: RunConfig, *, site_config: Mapping[str, ConfigValue] | None = None
) -> Result:
    """Train ``config.num_server_rounds`` rounds over ``grid``, recording every round.

    ``flplatform.start`` writes the run row first and commits each round as it finishes;
    if this process dies the run stays "running" with every finished round readable. A
    failure before the run starts (the test set, the model) is recorded as a failed run
    too. ``site_config``: sent with every message (``start``'s), for sites whose own run
    config is another run's.
    """
    options = platform_options(config)
    try:
        strategy = build_strategy(config)
        test = load_test_set(dataset=config.dataset, partition=config.partition, seed=config.seed)
        model = build_model(
            config.model,
            input_shape=test.input_shape,
            num_classes=test.num_classes,
            seed=config.seed,
        )
        # Sites that standardise their features with their own statistics train a model
        # for standardised inputs; the server's test set is not (no statistics leave the
        # sites), so the sites' evaluation is the run's (RunConfig requires one).
        evaluate_fn = (
            None
            if config.standardize_features
            else central_evaluator(test, model_name=config.model, seed=config.seed)
        )
    except BaseException as exc:
        record_failed_start(exc, strategy=config.strategy, **options)
        raise
    return start(
        strategy,
        grid,
        ArrayRecord(model.state_dict()),
        train_config=train_config_for(config),
        evaluate_fn=evaluate_fn,
        site_config=site_config,
        **options,
    )


def site_config_of(config: RunConfig) -> dict[str, ConfigValue]:
    """The keys of ``config`` a site reads (its data and model), as its run config says them."""
    values = config.to_run_config()
    return {key: values[key] for key in SITE_KEYS}


def member_site_config(
    member: RunConfig,
    app_keys: Mapping[str, ConfigValue],
    sites_run_config: Mapping[str, Any] | None,
) -> dict[str, ConfigValue] | None:
    """What a sweep member's messages tell its sites: its data and model keys and its own
    app keys; None where the sites' run config (the Flower run's; None: unknown) already
    says the same, so that a sweep of strategies on one dataset sends what a lone run
    sends. Anything in doubt is sent: sending more costs bytes, not correctness.
    """
    told = {**site_config_of(member), **app_keys}
    if sites_run_config is None:
        return told
    try:
        same_data = SiteDataConfig.from_run_config({**sites_run_config, **told}) == (
            SiteDataConfig.from_run_config(sites_run_config)
        )
    except ConfigError:  # a base value every member overrides: the sites read the member's
        return told
    same_app = all(
        type(sites_run_config.get(key)) is type(value) and sites_run_config.get(key) == value
        for key, value in app_keys.items()
    )
    return None if same_data and same_app else told


def run_members(
    grid: Grid,
    members: Sequence[RunConfig],
    *,
    app_keys: Sequence[Mapping[str, ConfigValue]] = (),
    sites_run_config: Mapping[str, Any] | None = None,
) -> None:
    """Run a sweep's members in order on ``grid``, each a run of its own in the ledger,
    each telling its sites what ``member_site_config`` says (``app_keys``: each member's
    own values of the app's keys, ``sweep.sweep_app_keys``).

    A member that fails with a domain error is recorded failed (``start`` records it) and
    the next one runs; anything else (Ctrl-C, SystemExit, a bug) stops the sweep. Between
    members, the replies the last one left in flight (stragglers of the async modes,
    cancelled work, unanswered evaluations) are pulled and dropped, so that the next
    member's messages neither queue behind them at the sites nor meet a site still busy
    with them.
    """
    tracked = InFlightGrid(watch_superlink(grid))
    watch = superlink_watch(tracked)
    for index, member in enumerate(members):
        if index:
            # watched too: a pull from a deployed SuperLink that died waits for ever
            drain = functools.partial(_drain, tracked, after=members[index - 1])
            run_watched(tracked, drain, lambda _: None)
        log.info("sweep: run %d of %d, %s", index + 1, len(members), member.run_name)
        own = app_keys[index] if index < len(app_keys) else {}
        try:
            run_federation(
                tracked, member, site_config=member_site_config(member, own, sites_run_config)
            )
        except FLPlatformError as exc:
            log.error("sweep: run %s failed: %s", member.run_name, exc.reason)
            if watch is not None and watch.gone is not None:
                raise  # no later member can run without the SuperLink


def _drain(grid: InFlightGrid, *, after: RunConfig) -> None:
    """Wait for the replies the member ``after`` left in flight (see ``run_members``)."""
    began, due = time.monotonic(), len(grid.unanswered)
    left = grid.drain(timeout=after.round_timeout + TTL_GRACE_SECONDS)
    log.info(
        "sweep: %d replies %s left in flight, drained in %.2f s%s",
        due,
        after.run_name,
        time.monotonic() - began,
        f"; {left} never came" if left else "",
    )


class InFlightGrid(ForwardingGrid):
    """A Grid that remembers which messages pushed through it still have a reply due."""

    def __init__(self, grid: Grid) -> None:
        super().__init__(grid)
        self.unanswered: set[str] = set()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = list(super().push_messages(messages))
        self.unanswered.update(i for i in ids if i)  # (refused ones: "" or None)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        replies = list(super().pull_messages(message_ids))
        self.unanswered.difference_update(r.metadata.reply_to_message_id for r in replies)
        return replies

    def drain(self, *, timeout: float, poll_interval: float = 0.02) -> int:
        """Pull and drop every reply still due, for at most ``timeout`` seconds.

        Flower answers every message, at the latest with an error once its TTL passed.
        Returns how many never came back (forgotten: a later pull does not ask for them).
        """
        deadline = time.monotonic() + timeout
        while self.unanswered and time.monotonic() < deadline:
            waiting = sorted(self.unanswered)
            pulled = 0
            for first in range(0, len(waiting), PULL_CHUNK):
                pulled += len(self.pull_messages(waiting[first : first + PULL_CHUNK]))
            if not pulled:
                time.sleep(poll_interval)
        left = len(self.unanswered)
        self.unanswered.clear()
        return left
