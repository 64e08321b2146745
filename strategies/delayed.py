"""Delayed compensated updates (DTS, "Distributed Training Across the World"; DGA).

ALGORITHMS.md §2; the bookkeeping is in ``strategies.compensation``. No site ever waits
for the latest global average:

* Period r at site n: p local steps from its local model give the accumulated step
  A_{n,r}; the site keeps it and sends it tagged with r.
* Round r's average Ā_r = Σ w_n A_{n,r} / Σ w_n (weights: examples) over the sites whose
  round-r update was included; the global model is x_r = x_{r−1} + η·Ā_r.
* A site may start period q as soon as it has sent period q − 1 and x_{q−1−D} exists:
  it is sent that D-round-old model, tells which of its own periods made it into the
  averages, and rebuilds x_local = x_{q−1−D} + (its periods since) — the swap
  x ← x − A_{n,r} + Ā_r in closed form. A period left out is carried into the next
  update instead of swapped.

With ``PeriodSync`` (the engine's policy for this strategy) round r is aggregated when
every period-r update is back, while fast sites run up to D periods ahead; on a virtual
clock their downloads and uploads overlap their computation, so with D large enough the
round trip leaves the critical path. D = 0 is local-SGD averaging, D = 0 with p = 1
synchronous SGD.

Choices: site momentum restarts every period (A_{n,r} is the period's net change, so the
swap leaves no residue); the server applies Ā_r with learning rate η and no momentum
(server momentum would make x_r differ from x_0 + Σ η Ā_j, which the swap relies on);
every site takes part in every period (no sampling). The reply's ``arrays`` hold A_{n,r},
not a model, so a plain Flower ClientApp cannot take part: its reply has no ``period``
and is rejected with a reason saying so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from clients.site import Site
from flplatform import keys
from flplatform.engine import Contribution, PeriodSync, start_with_engine
from flplatform.engine.wire import arrays_to_record, record_to_arrays
from flplatform.errors import ConfigError, UpdateRejected
from strategies.aggregation import ServerOptimizerState, WeightedDeltaSum, apply_server_update
from strategies.compensation import ServerLedger, SiteLedger
from strategies.local_sgd import (
    LocalSGDAveraging,
    SiteTrainConfig,
    aggregate_batch,
    first_number,
    train_from,
    training_report,
)
from strategies.site_parts import register
from strategies.validation import check_arrays, check_num_examples

log = logging.getLogger("flplatform.strategies.delayed")

SITE_ALGORITHM = "delayed"


@dataclass
class DelayedState:
    """Server state that outlives a round.

    ``models`` is the FIFO of the last D + 1 global models (version → record), what
    sites starting a period are sent; ``open`` holds one accumulator per period that
    has updates but no average yet (at most D + 1, however many sites there are).
    """

    ledger: ServerLedger
    version: int = 0
    models: dict[int, ArrayRecord] = field(default_factory=dict)
    open: dict[int, WeightedDeltaSum] = field(default_factory=dict)
    losses: dict[int, tuple[float, float]] = field(default_factory=dict)  # Σ n·loss, Σ n


class DelayedCompensated(Strategy):
    """Delayed compensated updates as a Flower Message-API strategy, run by the engine.

    Parameters
    ----------
    delay : int
        D ≥ 0: rounds between a period's end and its average reaching the site.
    num_rounds : int
        Rounds of the run: no site is given a period beyond the last.
    compensate : bool
        Swap the site's own stale steps for the averages (True), or train from the stale
        global model alone (False: plain delayed SGD, the ablation).
    eta : float
        Server learning rate η applied to each average.
    fraction_evaluate : float
        Fraction of idle sites asked to evaluate the global model after each round.
    seed : int
        Evaluation sampling depends only on (seed, round).
    """

    def __init__(
        self,
        *,
        delay: int,
        num_rounds: int,
        compensate: bool = True,
        eta: float = 1.0,
        fraction_evaluate: float = 0.0,
        seed: int = 0,
    ) -> None:
        if not (math.isfinite(eta) and eta > 0):
            raise ConfigError(f"server learning rate must be > 0, got {eta}")
        if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 1:
            raise ConfigError(f"num-rounds must be an integer >= 1, got {num_rounds!r}")
        self.delay = delay
        self.num_rounds = num_rounds
        self.compensate = bool(compensate)
        self.eta = eta
        self.seed = seed
        self.state = DelayedState(ledger=ServerLedger(delay))  # validates the delay
        self._round = 0
        self._current: dict[str, np.ndarray] = {}
        self._current_record: ArrayRecord | None = None
        # Evaluation and sampling are local-SGD averaging's; only training differs.
        self._evaluation = LocalSGDAveraging(fraction_evaluate=fraction_evaluate, seed=seed)

    def summary(self) -> None:
        """Log the configuration."""
        log.info(
            "DelayedCompensated: delay=%s compensate=%s eta=%s rounds=%s",
            self.delay,
            self.compensate,
            self.eta,
            self.num_rounds,
        )

    # ------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Start every idle site on its next period, if its D-round-old model exists."""
        ledger = self.state.ledger
        # Driven without begin_aggregation (Flower's own loop): the model given is current.
        self.state.models.setdefault(self.state.version, arrays)
        messages = []
        for node_id in sorted(grid.get_node_ids()):
            period = ledger.period_for(node_id, open_round=server_round, last_round=self.num_rounds)
            if period is None:
                continue
            version = ledger.version_for(period)
            site_config = ConfigRecord(dict(config))  # never write into the caller's record
            site_config.update(
                {
                    keys.SERVER_ROUND: period,
                    keys.MODEL_VERSION: version,
                    keys.SITE_ALGORITHM: SITE_ALGORITHM,
                    keys.DELAY: self.delay,
                    keys.COMPENSATE: self.compensate,
                    keys.INCLUDED_PERIODS: ledger.news_for(node_id, version),
                }
            )
            content = RecordDict(
                {keys.ARRAYS: self.state.models[version], keys.CONFIG: site_config}
            )
            messages.append(Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN))
            ledger.sent(node_id, period)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's batch hook: accumulate the round's replies and average them."""
        base = self.state.models[self.state.version]
        return aggregate_batch(self, server_round, base, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """As local-SGD averaging: a seeded sample of idle sites evaluates x_r."""
        return self._evaluation.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Example-weighted mean of the sites' evaluation metrics."""
        return self._evaluation.aggregate_evaluate(server_round, replies)

    # ------------------------------------------------- streaming aggregation
    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None:
        """Round ``server_round`` forms Ā_r on top of ``arrays`` (x_{r−1})."""
        state = self.state
        self._round = server_round
        if arrays is not self._current_record:  # decode each version once
            self._current, self._current_record = record_to_arrays(arrays), arrays
        state.models[state.version] = arrays
        oldest = state.version - self.delay  # what a site starting period r + D is sent
        state.models = {v: a for v, a in state.models.items() if v >= oldest}

    def accumulate(
        self, reply: Message, *, base: ArrayRecord, weight_scale: float = 1.0
    ) -> Contribution:
        """Add n_n·A_{n,q} to the accumulator of the period q the site computed."""
        node_id = reply.metadata.src_node_id
        ledger = self.state.ledger
        # Whatever the reply holds, the site answered: it is not re-offered the period.
        asked = ledger.answered(node_id)
        content = reply.content
        if keys.ARRAYS not in content or keys.METRICS not in content:
            raise UpdateRejected(
                f"reply must hold '{keys.ARRAYS}' and '{keys.METRICS}' records, "
                f"got {sorted(content.keys())}"
            )
        metrics = content[keys.METRICS]
        if not isinstance(metrics, MetricRecord):
            raise UpdateRejected(f"'{keys.METRICS}' must be a MetricRecord")
        period = metrics.get(keys.PERIOD)
        if isinstance(period, bool) or not isinstance(period, int):
            raise UpdateRejected(
                f"delayed updates carry the '{keys.PERIOD}' they were computed for, got "
                f"{period!r}: is the site running flplatform's delayed site part?"
            )
        if asked is None:
            raise UpdateRejected("no update was awaited from this site (a duplicate reply?)")
        if period != asked or period not in ledger.unsettled.get(node_id, set()):
            raise UpdateRejected(
                f"reply for period {period}, but this site was asked for period {asked}"
            )
        if period in ledger.included.get(node_id, set()):
            raise UpdateRejected(f"period {period} of this site was counted already")
        # The site has now settled everything up to the model it was sent, whatever
        # becomes of this update.
        ledger.acknowledged(node_id, ledger.version_for(period))
        if period < self._round:
            raise UpdateRejected(f"period {period} was averaged already (round {self._round})")
        num_examples = check_num_examples(metrics.get(keys.NUM_EXAMPLES))
        record = content[keys.ARRAYS]
        if not isinstance(record, ArrayRecord):
            raise UpdateRejected(f"'{keys.ARRAYS}' must be an ArrayRecord")
        try:
            update = record_to_arrays(record)
        except Exception as exc:  # not .npy bytes, pickled objects, truncated data
            raise UpdateRejected(f"arrays cannot be decoded: {exc}") from None
        check_arrays(update, self._current)
        self.state.open.setdefault(period, WeightedDeltaSum()).add(
            update, float(num_examples), scale=weight_scale
        )
        ledger.counted(node_id, period)
        loss = first_number(metrics, keys.TRAIN_LOSS_ALIASES)
        if loss is not None:
            total, weight = self.state.losses.get(period, (0.0, 0.0))
            self.state.losses[period] = (total + num_examples * loss, weight + num_examples)
        seconds = first_number(metrics, (keys.COMPUTE_SECONDS,))
        return Contribution(num_examples=num_examples, train_loss=loss, compute_seconds=seconds)

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """x_r = x_{r−1} + η·Ā_r; a round without included updates leaves x unchanged.

        Every round makes a version (an empty average is zero), so version r is always
        x_0 + Σ_{j ≤ r} η·Ā_j, the model sites starting period r + 1 + D are sent.
        """
        state = self.state
        acc = state.open.pop(self._round, None)
        metrics = MetricRecord({"num-updates": acc.count if acc else 0})
        if acc is not None and acc.count:
            self._current = apply_server_update(
                self._current, acc.mean(), eta=self.eta, beta=0.0, state=ServerOptimizerState()
            )
        total, weight = state.losses.pop(self._round, (0.0, 0.0))
        if weight > 0:
            metrics[keys.TRAIN_LOSS] = total / weight
        state.version += 1
        record = arrays_to_record(self._current)
        self._current_record = record
        state.models[state.version] = record
        return record, metrics

    # -------------------------------------------------------------- driving
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``start``, run by flplatform's round engine with ``PeriodSync``."""
        self.num_rounds = num_rounds
        return start_with_engine(
            self,
            grid,
            initial_arrays,
            policy=PeriodSync(),
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
            federated_evaluation=self._evaluation.fraction_evaluate > 0,
        )


# =============================================================== site part
@dataclass(frozen=True)
class DelayedSiteConfig:
    """The delayed-update part of a round's config, checked."""

    period: int
    version: int
    compensate: bool
    included: tuple[int, ...]

    @classmethod
    def from_record(cls, config: ConfigRecord) -> DelayedSiteConfig:
        """Parse; a missing or mistyped value is a ``ConfigError`` naming it."""
        period = config.get(keys.SERVER_ROUND)
        version = config.get(keys.MODEL_VERSION)
        for name, value in ((keys.SERVER_ROUND, period), (keys.MODEL_VERSION, version)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"round config '{name}' must be an integer >= 0, got {value!r}")
        compensate = config.get(keys.COMPENSATE, True)
        if not isinstance(compensate, bool):
            raise ConfigError(f"round config '{keys.COMPENSATE}' must be true or false")
        included = config.get(keys.INCLUDED_PERIODS, [])
        if not isinstance(included, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in included
        ):
            raise ConfigError(f"round config '{keys.INCLUDED_PERIODS}' must be a list of rounds")
        return cls(int(period), int(version), compensate, tuple(included))  # type: ignore[arg-type]


def load_site_ledger(context: Context) -> SiteLedger:
    """The site's kept periods and carry from its persistent state (empty at first)."""
    state = context.state
    index = state.config_records.get(keys.DELAYED_STATE, ConfigRecord())
    periods = index.get("pending", [])
    ledger = SiteLedger()
    for period in periods if isinstance(periods, list) else []:
        if isinstance(period, bool) or not isinstance(period, int):
            continue
        record = state.array_records.get(f"{keys.DELAYED_STATE}.{period}")
        if record is not None:
            ledger.pending[int(period)] = {
                k: v.astype(np.float64) for k, v in record_to_arrays(record).items()
            }
    carry = state.array_records.get(f"{keys.DELAYED_STATE}.carry")
    if carry is not None:
        ledger.carry = {k: v.astype(np.float64) for k, v in record_to_arrays(carry).items()}
    return ledger


def save_site_ledger(context: Context, ledger: SiteLedger) -> None:
    """Write the ledger back, dropping records of periods it no longer keeps."""
    state = context.state
    prefix = f"{keys.DELAYED_STATE}."
    for key in [k for k in state.array_records if k.startswith(prefix)]:
        del state[key]
    for period, update in ledger.pending.items():
        state[f"{prefix}{period}"] = arrays_to_record(update)
    if ledger.carry is not None:
        state[f"{prefix}carry"] = arrays_to_record(ledger.carry)
    state[keys.DELAYED_STATE] = ConfigRecord({"pending": sorted(ledger.pending)})


# A period's training step: from the start model's arrays and the round's config, the
# trained arrays and what to report (num-examples, train loss, compute seconds).
TrainStep = Callable[[dict[str, np.ndarray], SiteTrainConfig], tuple[dict[str, np.ndarray], dict]]


def run_period(msg: Message, context: Context, train: TrainStep) -> Message:
    """One period at a site: settle, rebuild the local model, ``train``, reply A_{n,q}.

    The site's kept periods are written back only once the update exists, so a site
    that fails mid-period keeps its state as it was and simply misses the period.
    """
    raw = msg.content.config_records.get(keys.CONFIG, ConfigRecord())
    config = SiteTrainConfig.from_record(raw)
    delayed = DelayedSiteConfig.from_record(raw)
    if keys.ARRAYS not in msg.content.array_records:
        raise ConfigError(f"the server's message has no '{keys.ARRAYS}' record")
    global_model = record_to_arrays(msg.content.array_records[keys.ARRAYS])

    ledger = load_site_ledger(context)
    ledger.settle(delayed.version, delayed.included)
    # Asked again for a period it already computed: its reply never counted (lost or
    # late), so that work is carried into this update instead of overwritten.
    ledger.retry(delayed.period)
    local = ledger.local_model(global_model, compensate=delayed.compensate)
    start = {k: local[k].astype(global_model[k].dtype) for k in global_model}
    trained, reported = train(start, config)
    update = ledger.record(delayed.period, start, trained, compensate=delayed.compensate)
    save_site_ledger(context, ledger)
    metrics = MetricRecord({**reported, keys.PERIOD: delayed.period})
    content = RecordDict({keys.ARRAYS: arrays_to_record(update), keys.METRICS: metrics})
    return Message(content, reply_to=msg)


@register(SITE_ALGORITHM)
def train_site(msg: Message, context: Context, site: Site) -> Message:
    """One period of p local SGD steps on the site's data (see ``run_period``)."""

    def train(start: dict[str, np.ndarray], config: SiteTrainConfig) -> tuple[dict, dict]:
        # The same data order local-SGD averaging would use, so D = 0 reproduces it.
        trained, stats = train_from(start, site, config, context)
        return trained, training_report(site, stats)

    return run_period(msg, context, train)
