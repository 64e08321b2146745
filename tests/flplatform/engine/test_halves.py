"""A strategy's two halves agree or the run stops: a server whose site half is a mod
(FetchSGD, Sketched-SGD, delayed updates) stops after the first round in which no site
replied with it, naming both halves and the fix; one site without it is only rejected.

The real engine, strategies, mods and SQL ledger; only the transport is in-process.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from flplatform.core import keys
from flplatform.core.errors import HalvesDisagree
from flplatform.engine import APPLIED, REJECTED, Synchrony
from flplatform.engine.engine import RoundEngine
from flplatform.engine.strategy import EngineStrategy
from flplatform.run.ledger import SqlLedger
from storage import LedgerRepository
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.local_sgd import LocalSGDAveraging
from strategies.mods import flplatform_mod
from strategies.mods.contract import reply_with
from strategies.sketched_sgd import SketchedSGD
from tests.helpers.delayed_sites import context
from tests.helpers.scripted_grid import Behaviour, ScriptedGrid

pytestmark = pytest.mark.usefixtures("task_identity")

MODEL = ArrayRecord({"w": Array(np.zeros(8, np.float32))})
ROUNDS = 4


def users_train(msg: Message, _: Context) -> Message:
    """A user's Flower train function: the model it was given, one step on."""
    trained = msg.content[keys.ARRAYS]["w"].numpy() + 0.5
    content = RecordDict(
        {
            keys.ARRAYS: ArrayRecord({"w": Array(trained.astype(np.float32))}),
            keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 10, keys.TRAIN_LOSS: 0.1}),
        }
    )
    return Message(content, reply_to=msg)


def site(name: str, *, with_mod: bool) -> Behaviour:
    contexts: dict[int, Context] = {}

    def behave(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            info = ConfigRecord({keys.SITE_NAME: name})
            return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)
        node = msg.metadata.dst_node_id
        state = contexts.setdefault(node, context(node))
        if with_mod:
            return flplatform_mod()(msg, state, users_train)
        return users_train(msg, state)

    return behave


def run(
    repository: LedgerRepository,
    strategy: EngineStrategy,
    *,
    with_mod: bool,
    without: tuple[str, ...] = (),
    **kwargs: object,
) -> int:
    """``strategy`` over sites a and b (with the mod or not) and the ``without`` ones."""
    run_id = repository.create_run(
        name="t", strategy=strategy.ledger_name, seed=0, config={}, num_rounds_planned=ROUNDS
    )
    names = {1: ("a", with_mod), 2: ("b", with_mod)}
    names.update({3 + i: (name, False) for i, name in enumerate(without)})
    grid = ScriptedGrid({n: site(name, with_mod=mod) for n, (name, mod) in names.items()})
    engine = RoundEngine(
        grid,
        strategy,
        ledger=SqlLedger(repository, run_id),
        policy=strategy.engine_policy(Synchrony("sync"), num_rounds=ROUNDS),
        required_sites=len(names),
        poll_interval=0.0,
        **kwargs,  # type: ignore[arg-type]
    )
    engine.run(MODEL, num_rounds=ROUNDS)
    return run_id


STRATEGIES = {
    "fetchsgd": lambda: FetchSGD(k=4, sketch_cols=32),
    "sketched-sgd": lambda: SketchedSGD(k=4, sketch_cols=32),
    "delayed": lambda: DelayedCompensated(delay=1, num_rounds=ROUNDS),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_site_without_the_strategys_mod_stops_the_run_after_its_round(
    name: str, repository: LedgerRepository
) -> None:
    with pytest.raises(HalvesDisagree) as stopped:
        run(repository, STRATEGIES[name](), with_mod=False)
    said = stopped.value.reason
    assert said.startswith(f"site a replied without flplatform's {name} mod"), said
    assert "flplatform_mod()" in said and f"the server runs {name}" in said
    run_id = repository.list_runs(limit=1)[0].id
    # The round is in the ledger, its updates rejected with the sentence.
    (only,) = repository.list_rounds(run_id)
    assert (only.round, only.num_applied, only.num_rejected) == (1, 0, 2)
    updates = repository.list_updates(run_id)
    assert {u.status for u in updates} == {REJECTED}
    assert any(u.reason == said for u in updates)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_one_site_without_the_mod_is_rejected_and_the_others_go_on(
    name: str, repository: LedgerRepository
) -> None:
    # Misconfigured, on an older flplatform, or hostile: it cannot end the others' run.
    run_id = run(repository, STRATEGIES[name](), with_mod=True, without=("odd",))
    assert len(repository.list_rounds(run_id)) == ROUNDS
    updates = repository.list_updates(run_id)
    odd = [u for u in updates if u.site == "odd"]
    assert odd and all(u.status == REJECTED for u in odd)
    assert all("replied without flplatform's" in (u.reason or "") for u in odd)
    assert {u.status for u in updates if u.site != "odd"} == {APPLIED}


def test_never_stop_keeps_a_run_whose_sites_lack_the_mod_going(
    repository: LedgerRepository,
) -> None:
    run_id = run(repository, STRATEGIES["fetchsgd"](), with_mod=False, max_failed_rounds=0)
    assert len(repository.list_rounds(run_id)) == ROUNDS


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_sites_with_the_mod_run_every_round(name: str, repository: LedgerRepository) -> None:
    run_id = run(repository, STRATEGIES[name](), with_mod=True)
    statuses = {u.status for u in repository.list_updates(run_id)}
    assert statuses == {APPLIED}
    assert len(repository.list_rounds(run_id)) == ROUNDS


def test_local_sgd_takes_plain_clientapps_and_its_own_mod(repository: LedgerRepository) -> None:
    for with_mod in (False, True):
        run_id = run(repository, LocalSGDAveraging(), with_mod=with_mod)
        assert {u.status for u in repository.list_updates(run_id)} == {APPLIED}


def test_a_reply_from_another_algorithms_mod_names_both() -> None:
    from flplatform.engine.replies import halves_disagree

    reply = Message(
        RecordDict({keys.CONFIG: ConfigRecord(_said_by(keys.DELAYED))}),
        reply_to=Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN),
    )
    assert halves_disagree(None, reply, "a", "local-sgd") == (
        "site a answered with flplatform's delayed mod, but the server runs local-sgd: add "
        "flplatform_mod() to the site's @app.train(mods=[...]) (it follows the server), or "
        "run the server with strategy delayed"
    )
    assert halves_disagree(keys.DELAYED, reply, "a", "delayed") is None


def _said_by(mod: str, **protocol: int) -> dict[str, object]:
    return {keys.SITE_MOD: mod, keys.SITE_MOD_PROTOCOL: keys.MOD_PROTOCOL, **protocol}


@pytest.mark.parametrize(
    "said,theirs",
    [
        ({keys.SITE_MOD: keys.DELAYED}, "an older protocol"),
        (_said_by(keys.DELAYED, **{keys.SITE_MOD_PROTOCOL: keys.MOD_PROTOCOL + 1}), "protocol 2"),
    ],
)
def test_a_mod_speaking_another_protocol_is_refused_naming_both(
    said: dict[str, object], theirs: str
) -> None:
    from flplatform.engine.replies import halves_disagree

    reply = Message(
        RecordDict({keys.CONFIG: ConfigRecord(said)}),
        reply_to=Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN),
    )
    expected = (
        f"site a answered with flplatform's delayed mod speaking {theirs}, but the server "
        f"speaks mod protocol {keys.MOD_PROTOCOL}: install the same flplatform release at "
        "the sites and the server"
    )
    assert halves_disagree(keys.DELAYED, reply, "a", "delayed") == expected
    assert halves_disagree(None, reply, "a", "local-sgd") == expected


def test_a_mod_reply_states_the_protocol() -> None:
    """(Every algorithm's real mod replies pass the check: test_sites_with_the_mod_...)"""
    from flplatform.engine.replies import halves_disagree

    reply = reply_with(
        Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN),
        None,
        MetricRecord({keys.NUM_EXAMPLES: 1}),
    )
    assert reply.content[keys.CONFIG][keys.SITE_MOD_PROTOCOL] == keys.MOD_PROTOCOL
    assert halves_disagree(None, reply, "a", "local-sgd") is None
