"""Flower's internals that flplatform uses, in one place, checked against the installed Flower.

Everywhere else flplatform speaks Flower's public API (``flwr.app``, ``flwr.serverapp``,
``flwr.clientapp``, the ``flwr`` and ``flower-*`` commands). A few things have no public
form, and each is reached through this module only:

* byte metering (``flplatform.engine.wire``) rebuilds the Fleet API's envelopes: the
  Fleet protos, ``message_to_proto``, ``metadata_to_proto``, ``ArrayChunk``, the object
  header's dividers and the array chunk size;
* median and trimmed-mean aggregation reuse ``flwr.server.strategy.aggregate``;
* an array travels as NumPy's ``.npy`` bytes under Flower's ``SType.NUMPY``;
* a wrapped Flower strategy's replies are checked as Flower's own strategies check them
  (``validate_message_reply_consistency``, ``InconsistentMessageReplies``);
* a simulation runs Flower's ``flwr-simulation`` entry point with a patched actor pool
  that replaces a Ray actor whose process died (``BasicActorPool``, its ``submit`` and
  its private ``_future_to_actor``, ``pool`` and ``create_actor_fn``);
* an app directory is read and checked as ``flwr run`` reads it (``validate_config``,
  ``flatten_dict``) and staged with the file filter it applies, a deployment
  writes its connection into Flower's ``config.toml`` starting from Flower's default
  text, and a ClientApp module is imported under Flower's own import lock.

Those the engine needs are looked up when this module is imported; those that import Ray
or Flower's CLI, when first asked for. A Flower release that moved one fails there with a
``FlowerVersionError`` naming the installed Flower, the internal and the supported range,
not with an ``AttributeError`` in the middle of a run. ``SUPPORTED_FLOWER`` is the range
the test suite runs on (a fresh ``make test``, as in CI, installs the newest release in
it; ``make test-flower-oldest`` runs on the oldest); ``pyproject.toml`` pins the same
range.
"""

from __future__ import annotations

import importlib
import itertools
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from flplatform.core.errors import FlowerVersionError

# The oldest supported release, and the first release not supported (pyproject.toml's pin).
SUPPORTED_FLOWER = ("1.41.0", "1.43")


def flower_version() -> str:
    """The installed Flower's version ("unknown" without its package metadata)."""
    try:
        return version("flwr")
    except PackageNotFoundError:  # pragma: no cover - Flower run from a source tree
        return "unknown"


def release(text: str) -> tuple[int, ...]:
    """A version's release numbers ("1.42.0rc1" → (1, 42, 0)), for ordering versions."""
    numbers: list[int] = []
    for part in text.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def internal(module: str, name: str) -> Any:
    """``name`` (dotted for a member: ``"Class.member"``) from Flower's ``module``, or a
    ``FlowerVersionError`` naming what the installed Flower lacks."""
    try:
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
        return found
    except (ImportError, AttributeError) as exc:
        oldest, beyond = SUPPORTED_FLOWER
        raise FlowerVersionError(
            f"flplatform needs Flower's {module}.{name}, which the installed Flower "
            f"{flower_version()} does not have ({exc}); flplatform supports Flower "
            f">= {oldest}, < {beyond}: pip install 'flwr[simulation]>={oldest},<{beyond}'"
        ) from None


# -------------------------------------------------------------- byte metering (engine.wire)
_FLEET = "flwr.proto.fleet_pb2"
PullMessagesRequest = internal(_FLEET, "PullMessagesRequest")
PullMessagesResponse = internal(_FLEET, "PullMessagesResponse")
PushMessagesRequest = internal(_FLEET, "PushMessagesRequest")
PushMessagesResponse = internal(_FLEET, "PushMessagesResponse")
Reconnect = internal(_FLEET, "Reconnect")
ProtoMessage = internal("flwr.proto.message_pb2", "Message")
ObjectTree = internal("flwr.proto.message_pb2", "ObjectTree")
Node = internal("flwr.proto.node_pb2", "Node")
ProtoRecordDict = internal("flwr.proto.recorddict_pb2", "RecordDict")
message_to_proto = internal("flwr.common.serde", "message_to_proto")
metadata_to_proto = internal("flwr.common.serde_utils", "metadata_to_proto")
remove_content_from_message = internal("flwr.app.message", "remove_content_from_message")
ArrayChunk = internal("flwr.app.message.arraychunk", "ArrayChunk")
SUPERLINK_NODE_ID = internal("flwr.common.constant", "SUPERLINK_NODE_ID")
ErrorCode = internal("flwr.common.constant", "ErrorCode")
HEAD_BODY_DIVIDER = internal("flwr.supercore.constant", "HEAD_BODY_DIVIDER")
HEAD_VALUE_DIVIDER = internal("flwr.supercore.constant", "HEAD_VALUE_DIVIDER")
_CHUNK_SIZE = "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE"
internal("flwr.app.message.array", _CHUNK_SIZE)
_ARRAY_MODULE = importlib.import_module("flwr.app.message.array")


def max_array_chunk_size() -> int:
    """The bytes per chunk Flower splits an ``Array`` into, read at each call (Flower's
    tests, and ours, change it)."""
    return int(getattr(_ARRAY_MODULE, _CHUNK_SIZE))  # per message measured: no lookup


# ---------------------------------------------------------------- arrays (core.arrays)
NUMPY_STYPE = internal("flwr.common.constant", "SType.NUMPY")


# ---------------------------------- a wrapped Flower strategy's replies (run.flower_adapter)
validate_message_reply_consistency = internal(
    "flwr.serverapp.strategy.strategy_utils", "validate_message_reply_consistency"
)
InconsistentMessageReplies = internal("flwr.serverapp.exception", "InconsistentMessageReplies")


# ------------------------------------------------------- robust aggregation (local-SGD)
aggregate_median = internal("flwr.server.strategy.aggregate", "aggregate_median")
aggregate_trimmed_avg = internal("flwr.server.strategy.aggregate", "aggregate_trimmed_avg")


# -------------------------------------- looked up when first needed (Ray, Flower's CLI)
_ACTOR_MODULE = "flwr.simulation.ray_transport.ray_actor"


def actor_pool() -> Any:
    """Flower's simulation actor pool class, with the members the dead-actor patch uses
    (``launch.simulation_runtime``) checked; the private ones are set per instance."""
    internal(_ACTOR_MODULE, "BasicActorPool.add_actor_back_to_pool")
    internal(_ACTOR_MODULE, "BasicActorPool.submit")
    return internal(_ACTOR_MODULE, "BasicActorPool")


def simulation_entry_point() -> Any:
    """What Flower's ``flwr-simulation`` command runs."""
    return internal("flwr.simulation.app", "flwr_simulation")


def app_config_checks() -> tuple[Any, Any]:
    """How ``flwr run`` checks an app's pyproject.toml and flattens its config table:
    ``(validate_config, flatten_dict)`` from ``flwr.common.config``."""
    module = "flwr.common.config"
    return internal(module, "validate_config"), internal(module, "flatten_dict")


def publish_filter() -> Any:
    """The filter ``flwr run`` applies to an app directory's files (``flwr.cli.utils``)."""
    return internal("flwr.cli.utils", "filter_paths_for_publish")


def default_flower_config() -> str:
    """The text of a new ``$FLWR_HOME/config.toml``, as Flower writes it."""
    return str(internal("flwr.cli.constant", "DEFAULT_FLOWER_CONFIG_TOML"))


def import_lock() -> Any:
    """The lock Flower holds while it imports an app's module, or None where there is
    none (then importing needs no lock: ``clients.models``)."""
    try:
        return internal("flwr.supercore.object_ref", "_import_lock")
    except FlowerVersionError:
        return None
