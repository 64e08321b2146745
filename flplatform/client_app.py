"""The generic flplatform ClientApp: one per site, dispatching to strategies' site parts.

It answers three message types: QUERY (who are you: name, partition, examples, device),
TRAIN (run the site part named in the round's config, ``local-sgd`` by default) and
EVALUATE (the global model on the site's local validation slice).
"""

from __future__ import annotations

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from clients.site import Site, load_site
from flplatform import keys

# Importing a strategy module registers its site part under its site-algorithm name.
from strategies import delayed, fetchsgd, sketched_sgd  # noqa: F401  (register site parts)
from strategies.local_sgd import SITE_ALGORITHM, evaluate_site
from strategies.site_parts import site_part

app = ClientApp()


def _site(context: Context) -> Site:
    if keys.NUM_PARTITIONS in context.node_config:
        # Simulated sites share the machine: one thread each runs faster in total than
        # oversubscribed threads (two 1-thread processes give 1.9x on 2 cores).
        torch.set_num_threads(1)
    return load_site(context.node_config, context.run_config)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Introduce the site to the server."""
    site = _site(context)
    info = ConfigRecord(
        {
            keys.SITE_NAME: site.name,
            keys.NUM_EXAMPLES: len(site.x_train),
            keys.DEVICE: str(site.device),
        }
    )
    if site.partition_id is not None:
        info[keys.PARTITION_ID] = site.partition_id
    return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run the strategy's site part on this site's data."""
    algorithm = str(msg.content[keys.CONFIG].get(keys.SITE_ALGORITHM, SITE_ALGORITHM))
    return site_part(algorithm)(msg, context, _site(context))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the global model on this site's local validation data."""
    return evaluate_site(msg, context, _site(context))
