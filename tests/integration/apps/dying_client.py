"""A ClientApp whose partition-1 site kills its own process in round 2; the others are honest.

In simulation the process is the Ray actor running the ClientApp: what a crashing native
library, ``os._exit`` or the OOM killer does to it. Every other message, the dying site's
included, is flplatform's own ClientApp code.
"""

from __future__ import annotations

import os
import signal

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients import client_app as honest

DYING_PARTITION = 1
DYING_ROUND = 2

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    return honest.query(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    if partition == DYING_PARTITION and msg.content["config"]["server-round"] == DYING_ROUND:
        os.kill(os.getpid(), signal.SIGKILL)
    return honest.train(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return honest.evaluate(msg, context)
