"""The attack app's ClientApp: flplatform's built-in site, one of them attacking.

The built-in train, query and evaluate functions (clients/client_app.py), with
``attack_mod()`` in front of ``flplatform_mod()``: the run config's ``attack.kind``,
``attack.site``, ``attack.round`` and ``attack.scale`` pick the attack (clients/attacks.py).
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients import client_app as builtin
from clients.attacks import attack_mod
from strategies.mods import flplatform_mod

app = ClientApp()


@app.train(mods=[attack_mod(), flplatform_mod()])
def train(msg: Message, context: Context) -> Message:
    """The built-in site's training (its own function, without its app's mods)."""
    return builtin.train(msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Introduce the site honestly: the attacks are in its training replies."""
    return builtin.query(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate honestly."""
    return builtin.evaluate(msg, context)
