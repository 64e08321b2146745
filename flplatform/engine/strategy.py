"""What the round engine asks of a strategy: ``EngineStrategy``, and what it hands back.

A strategy keeps Flower's hooks (``configure_train``, ``configure_evaluate``,
``aggregate_evaluate``) and adds four streaming ones (``begin_aggregation``, ``read_update``,
``add_update``, ``finish_aggregation``). Reading and adding are two steps so that the
engine's ``UpdateGuard`` sits between them, the same for every strategy: the strategy says
what an update is (``Update``: its vector and claimed examples), the guard how much of it
counts (the weight and scale ``add_update`` gets); ``accumulate`` is both, unguarded.
Everything else the engine or ``flplatform.start`` needs to know about a strategy is
declared here too, each with a default, so a strategy states only what
differs: the work a message asks for (``work_for``), what to undo for a message that was
not sent (``message_not_sent``), the policy it runs under (``engine_policy``: the
strategy–policy pairing, said once, beside the strategy) and its name in the ledger.
Subclass ``EngineStrategy`` to inherit the defaults.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from flplatform.engine.policy import AggregationPolicy
from flplatform.engine.synchrony import Synchrony


@dataclass(frozen=True)
class Contribution:
    """What the strategy read from an accepted reply."""

    num_examples: int
    train_loss: float | None = None
    compute_seconds: float | None = None
    # What the ledger should know about an accepted update (its row's reason), e.g. that
    # the site lost its kept state and was resynced.
    note: str | None = None


@dataclass(frozen=True)
class Update:
    """One reply, read and checked by the strategy, not yet added to the round.

    Parameters
    ----------
    contribution : Contribution
        What the ledger records of it (the examples the site claims, its loss, ...).
    vector : sequence of arrays
        What the update adds to the round, before weighting: the guard judges its norm
        and direction. (Model deltas, a sketch table, values at coordinates.)
    averaged : sequence of arrays
        What it adds to the float arrays the round averages as they are (running
        statistics: ``strategies.averaged_arrays.judged_changes``), kept out of ``vector``:
        the guard judges them apart (``flplatform.engine.guard.AVERAGED_KIND``).
    kind : str
        Updates are compared only with those of the same kind ("delta", "sketch", ...).
    payload : object
        The strategy's own, handed back to ``add_update`` (a period, decoded arrays, ...).
    """

    contribution: Contribution
    vector: Sequence[np.ndarray]
    kind: str = "delta"
    payload: Any = None
    averaged: Sequence[np.ndarray] = ()


@dataclass(frozen=True)
class Work:
    """What one training message asks of its site, as the strategy that drafted it says.

    Parameters
    ----------
    period : int
        The round whose aggregate the update is for: the round open at dispatch, unless
        the strategy lets sites work ahead (delayed updates, under a pipelined policy).
    model_version : int
        The global model version the message carries (at most the current one); the
        staleness of the update is counted from it.
    delay : int, optional
        Delayed updates: how many averages the model lacks at the period's start (the
        ledger's ``delay``; its ``period`` and ``average_applied`` are then written too).
        None: the update has no period columns.
    fragment : int, optional
        Streaming sync: the index of the model fragment the update carries (0-based); None:
        the whole model.
    """

    period: int
    model_version: int
    delay: int | None = None
    fragment: int | None = None


@runtime_checkable
class EngineStrategy(Protocol):
    """The hooks the engine calls; Flower's own, streaming aggregation, and declarations.

    The first seven are required. The rest have defaults, inherited by subclassing this
    protocol (``class MyStrategy(Strategy, EngineStrategy)``); override one to state what
    differs.
    """

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Training messages for some of ``grid``'s nodes (the ones the engine offers)."""
        ...

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluation messages for some of ``grid``'s nodes (idle ones)."""
        ...

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The round's evaluation metrics from the replies that came back."""
        ...

    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None:
        """Start forming the next model version on top of ``arrays``."""
        ...

    def read_update(self, reply: Message, *, base: ArrayRecord) -> Update:
        """Read and check one reply (trained on ``base``), or raise ``UpdateRejected``.

        Adds nothing yet: the update counts once ``add_update`` is called with it.
        """
        ...

    def add_update(self, update: Update, *, weight: float, scale: float = 1.0) -> str | None:
        """Add ``update`` to the round: Σ += weight·scale·u, Σw += weight.

        ``weight`` is the examples it counts for (the claim, or the guard's cap);
        ``scale`` discounts the update itself (staleness, or the guard's clipping) without
        being renormalised away. Called at most once per update, after the guard is done
        with it: neither reads the update again, so a strategy may reuse its memory.
        Returns a note for the ledger when the strategy counted it otherwise than asked
        (a robust aggregator's clipping), else None.
        """
        ...

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The new model version (None: unchanged) and the round's training metrics.

        Raises ``StepRefused`` when the step would make the model unusable (non-finite);
        the strategy's state is then as it was before the step.
        """
        ...

    # ------------------------------------------------ declarations, with defaults
    def accumulate(
        self, reply: Message, *, base: ArrayRecord, weight_scale: float = 1.0
    ) -> Contribution:
        """Read one reply and add it with the examples it claims (no guard)."""
        update = self.read_update(reply, base=base)
        self.add_update(update, weight=update.contribution.num_examples, scale=weight_scale)
        return update.contribution

    def work_for(self, message: Message, *, server_round: int, model_version: int) -> Work:
        """The work ``message`` (drafted by ``configure_train``) asks of its site.

        Called for every training message the engine is about to send (or that its site
        sits out). Default: the open round's period on the current model version.
        """
        return Work(period=server_round, model_version=model_version)

    def message_not_sent(self, message: Message) -> None:
        """Undo what drafting ``message`` assumed: the engine did not send it.

        Called for a message from ``configure_train`` whose site sits the work out
        (simulated availability), e.g. so that sparse downloads keep the site's synced
        version. Default: nothing to undo.
        """
        return None

    def engine_policy(self, requested: Synchrony, *, num_rounds: int) -> AggregationPolicy:
        """The policy to run ``num_rounds`` rounds under, given the mode the run asked for.

        Called once before the run by ``flplatform.start``; raises ``ConfigError`` saying
        why for a mode the strategy cannot run. Default: the requested mode, as it is.
        """
        return requested

    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to go on after the last finished round.

        Called by the engine between rounds (after ``finish_aggregation`` and after the
        messages of the next round's work, if any, were drafted and sent); plain
        checkpoint data (``flplatform.core.checkpoint``), node ids as they are. The strategy's
        configuration is not in it: a resumed run builds the strategy from the same
        options. Default: nothing (a strategy that keeps no state across rounds).
        """
        return {}

    def load_state_dict(
        self, state: Mapping[str, Any], *, nodes: Mapping[int, int] | None = None
    ) -> None:
        """Restore ``state_dict()`` output into a strategy built with the same options.

        ``nodes`` maps the node ids the state names to this run's (a resumed run's sites
        join with new node ids; None: the same ids). Raises ``CheckpointError`` listing
        every problem (``flplatform.core.checkpoint.StateProblems``), leaving the strategy as
        it was.
        """
        if state:
            from flplatform.core.checkpoint import CheckpointError

            raise CheckpointError(
                f"{type(self).__name__} keeps no state, but the checkpoint holds {sorted(state)}"
            )

    @property
    def ledger_name(self) -> str:
        """The strategy's name in the ledger (default: its class name)."""
        return type(self).__name__

    @property
    def site_mod(self) -> str | None:
        """The algorithm whose ClientApp mod must answer the training messages (named by
        ``keys.SITE_MOD`` in each reply's config); None when any Flower ClientApp's
        whole-model reply will do (default). A reply without it is rejected; a round in
        which no reply had it stops the run."""
        return None

    def summary(self) -> None:
        """Log the strategy's configuration (default: nothing)."""
        return None

    def take_warning(self) -> str | None:
        """What the last step revealed about the whole run that the user must know (a
        robust aggregator that outvoted no one), once; None when nothing (default). The
        engine records it with the round, as it does a divergence report: the console
        shows it while the run trains, and ``history`` with the run."""
        return None


class ForwardingGrid(Grid):
    """A Grid that forwards every call to ``grid``; subclasses change what they need.

    ``_before`` runs before each call that reaches the SuperLink (a check, in
    ``flplatform.engine.link``); it does nothing here.
    """

    def __init__(self, grid: Grid) -> None:
        self._grid = grid

    def _before(self) -> None:
        return None

    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        self._before()
        return self._grid.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:
        self._before()
        return self._grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self._before()
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self._before()
        return self._grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        self._before()
        return self._grid.send_and_receive(messages, timeout=timeout)


class SubsetGrid(ForwardingGrid):
    """A view of a Grid whose ``get_node_ids`` lists only some nodes, in the given order.

    The engine hands it to ``configure_train`` so that a strategy's own sampling picks
    among the sites the policy allows (idle ones), without the strategy knowing why. It
    lists them by site name (``Sites.by_name``): Flower's node ids change with every
    start-up, and a seeded sample must pick the same sites in every invocation.
    """

    def __init__(self, grid: Grid, node_ids: Sequence[int]) -> None:
        super().__init__(grid)
        self._node_ids = list(node_ids)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)
