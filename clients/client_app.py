"""The built-in task's ClientApp: an ordinary Flower app on the platform's public API.

Its ``train`` is a plain Flower train function (the received model, H local SGD steps or
E epochs on the site's data, the trained model and ``num-examples`` back) and gets every
algorithm through ``flplatform_mod``, like any user's app; ``query`` introduces the site
to the server; ``evaluate`` scores the global model on the site's local validation slice.
Nothing here imports server code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.site import LocalSite, load_site, run_config_of
from clients.training import evaluate as evaluate_model
from clients.training import train_local
from flplatform.core import keys
from flplatform.core.checks import Problem, integer, positive, require, unit_interval
from flplatform.core.errors import ConfigError
from flplatform.core.seeding import rng_for
from strategies.mods import flplatform_mod
from strategies.mods.snapshots import work_of

app = ClientApp()


@dataclass(frozen=True)
class SiteTrainConfig:
    """What a site is told each round, read from the ``config`` record with defaults."""

    server_round: int = 0
    seed: int = 0
    lr: float = 0.1
    momentum: float = 0.0
    batch_size: int = 32
    local_steps: int = 0
    local_epochs: int = 1

    @classmethod
    def from_record(cls, config: ConfigRecord) -> SiteTrainConfig:
        """Parse the round's config; a value of the wrong type or out of its range is a
        ``ConfigError`` naming every such key (a batch size of 0 divided by zero, a
        negative one trained on all but the last examples, 2.7 steps were taken as 2)."""
        values: dict[str, int | float] = {}
        problems: list[Problem] = []
        for f in fields(cls):
            key = f.name.replace("_", "-")
            raw = config.get(key)
            if raw is None:
                continue
            name = f"round config '{key}'"
            if f.type in ("float", float):
                problem = _FLOAT_RULES[f.name](raw, name)
                value: int | float = float(raw) if isinstance(raw, int | float) else 0.0
            else:
                whole = int(raw) if isinstance(raw, float) and raw.is_integer() else raw
                problem = integer(whole, name, minimum=_LEAST[f.name])
                value = whole if isinstance(whole, int) else 0
            problems.append(problem)
            values[f.name] = value
        require(problems)
        return cls(**values)  # type: ignore[arg-type]


# What the site accepts of the server's numbers (the server's own rules: flplatform.app).
_FLOAT_RULES: dict[str, Callable[[object, str], Problem]] = {
    "lr": lambda value, name: positive(value, name, says="a finite number > 0"),
    "momentum": lambda value, name: unit_interval(value, name, says="a number in [0, 1)"),
}
_LEAST = {"server_round": 0, "seed": 0, "batch_size": 1, "local_steps": 0, "local_epochs": 0}


def site_of(msg: Message, context: Context) -> LocalSite:
    """This process's site for ``msg``'s run (loaded once), from the node config and the
    run config (``run_config_of``)."""
    if keys.NUM_PARTITIONS in context.node_config:
        # Simulated sites share the machine: one thread each runs faster in total than
        # oversubscribed threads (two 1-thread processes give 1.9x on 2 cores).
        torch.set_num_threads(1)
    return load_site(context.node_config, run_config_of(msg, context))


def received_model(msg: Message, site: LocalSite, seed: int = 0) -> torch.nn.Module:
    """The run's model for this site's inputs, holding the arrays the message carries."""
    if keys.ARRAYS not in msg.content.array_records:
        raise ConfigError(f"the server's message has no '{keys.ARRAYS}' record")
    state_dict = msg.content.array_records[keys.ARRAYS].to_torch_state_dict()
    # The output width of the model the server sent is its last array's first dimension.
    num_classes = int(list(state_dict.values())[-1].shape[0])
    model = site.build_model(num_classes=num_classes, seed=seed)
    model.load_state_dict(state_dict)
    return model


def count_training(context: Context) -> int:
    """How many training messages this site ran before this one (kept in its state).

    A site may train twice on one round's model (the K-batch modes give a finished site
    work again at once), so its data order follows (seed, round, site, trainings).
    """
    state = context.state.config_records.get(keys.SITE_STATE, ConfigRecord())
    done = state.get(keys.TRAININGS, 0)
    done = done if isinstance(done, int) and not isinstance(done, bool) and done >= 0 else 0
    context.state[keys.SITE_STATE] = ConfigRecord({**state, keys.TRAININGS: done + 1})
    return done


def data_order(
    msg: Message, context: Context, config: SiteTrainConfig, site: str
) -> np.random.Generator:
    """The generator of this training's data order: a function of the work, not the process.

    Our engine numbers each site's training messages (``site-work``), so a resumed run,
    a new Flower run with an empty ``context.state``, draws the order the uninterrupted
    run drew. Without it (another server), the site counts its own trainings.
    """
    work = work_of(msg)
    trainings = count_training(context)
    if work is not None:
        return rng_for(
            config.seed, config.server_round, site, "site-work", work.index, "data-order"
        )
    return rng_for(config.seed, config.server_round, site, trainings, "data-order")


@app.train(mods=[flplatform_mod()])
def train(msg: Message, context: Context) -> Message:
    """Train the received model for H steps or E epochs on the site's data; reply with it."""
    site = site_of(msg, context)
    config = SiteTrainConfig.from_record(
        msg.content.config_records.get(keys.CONFIG, ConfigRecord())
    )
    model = received_model(msg, site, config.seed)
    order = data_order(msg, context, config, site.name)
    stats = train_local(
        model,
        site.x_train,
        site.y_train,
        lr=config.lr,
        momentum=config.momentum,
        batch_size=config.batch_size,
        local_steps=config.local_steps,
        local_epochs=config.local_epochs,
        rng=order,
        device=site.device,
    )
    metrics = MetricRecord(
        {
            keys.NUM_EXAMPLES: len(site.x_train),
            keys.TRAIN_LOSS: stats.loss,
            keys.FIRST_BATCH_LOSS: stats.first_loss,
            keys.COMPUTE_SECONDS: stats.seconds,
        }
    )
    content = RecordDict({keys.ARRAYS: ArrayRecord(model.state_dict()), keys.METRICS: metrics})
    return Message(content, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Introduce the site to the server."""
    site = site_of(msg, context)
    info = ConfigRecord(
        {
            keys.SITE_NAME: site.name,
            keys.NUM_EXAMPLES: len(site.x_train),
            keys.DEVICE: str(site.device),
            # lets the server say why training that diverges does (features far from 1)
            keys.FEATURE_SCALE: site.feature_scale,
        }
    )
    if site.partition_id is not None:
        info[keys.PARTITION_ID] = site.partition_id
    return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the global model on this site's local validation data."""
    site = site_of(msg, context)
    model = received_model(msg, site)
    x, y = (site.x_val, site.y_val) if len(site.x_val) else (site.x_train, site.y_train)
    loss, accuracy = evaluate_model(model, x, y, device=site.device)
    metrics = MetricRecord(
        {keys.NUM_EXAMPLES: len(x), keys.EVAL_LOSS: loss, keys.EVAL_ACCURACY: accuracy}
    )
    return Message(RecordDict({keys.METRICS: metrics}), reply_to=msg)
