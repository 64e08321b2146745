"""``flwr-simulation`` as flplatform starts it: Flower's own, with dead sites' actors replaced.

Flower 1.41's Ray backend runs every simulated site's ClientApp on a fixed pool of Ray
actors (``flwr.simulation.ray_transport.ray_actor.BasicActorPool``). When a ClientApp ends
its actor's process (``os._exit``, a signal, a segfault, the OOM killer), ``ray.get``
raises ``ActorDiedError``: the backend answers that site's message with an error (right:
the site failed) but puts the dead actor back into the pool (``add_actor_back_to_pool``),
and every later message handed to it fails with "The actor is dead". The pool shrinks for
the rest of the run and healthy sites are dropped, round after round.

Flower's backend config has no setting for this. Ray's own (``max_restarts`` on the actor)
is not enough: a message handed to the actor while it restarts fails too
(``ActorUnavailableError``), dropping another healthy site. So the pool starts a new actor
in the dead one's place instead, and takes it in once its process is up (it imports
torch and the app first: seconds): meanwhile the next sites go to the actors that are
alive, rather than wait in line for the new one. A site's ``Context`` lives in the
driver process, so nothing of any site's state is lost. The dying site's message is
answered with Flower's error, which the engine records as that site's dropped update with
the reason; the other sites go on, and the dying site too, on its next message.

It also keeps Ray on this machine's loopback interface (:func:`keep_ray_on_loopback`): every
Ray process of a simulation (gcs_server, raylet, the agents, the ClientApp actors) listens
on 127.0.0.1 only, never on an address another machine can reach.

flplatform's CLI puts a ``flwr-simulation`` script that runs :func:`main` first on the
PATH of the SuperLink it starts (``flower.flower_environment``); SuperExec starts the
simulation process by that name. Everything else is Flower's ``flwr-simulation``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from flplatform.core.errors import FlowerVersionError
from flplatform.core.flower_internals import (
    actor_pool,
    flower_version,
    simulation_entry_point,
)
from flplatform.launch.processes import process_table
from flplatform.run.owner import named_owner, owner_gone

log = logging.getLogger("flplatform")
# Taking an idle actor from Flower's pool, one worker thread at a time; how often a
# worker looks again while every actor is busy or starting; and how long a replacement
# actor may take to start (or a message wait for an actor) before that is said.
_POOL_LOCK = threading.Lock()
_POOL_WAIT_SECONDS = 0.01
_ACTOR_START_SECONDS = 300.0


def replace_dead_actors() -> None:
    """Make Flower's actor pool replace an actor whose process died (see the module)."""
    pool_class = actor_pool()
    put_back = pool_class.add_actor_back_to_pool
    if getattr(put_back, "replaces_dead_actors", False):
        return

    def add_actor_back_to_pool(self: Any, future: Any) -> None:
        if not _actor_died(future):
            put_back(self, future)
            return
        import ray

        if not all(hasattr(self, m) for m in ("_future_to_actor", "pool", "create_actor_fn")):
            raise FlowerVersionError(
                f"Flower {flower_version()}'s actor pool no longer has the members that "
                "replace a dead actor (_future_to_actor, pool, create_actor_fn)"
            )
        dead = self._future_to_actor.pop(future)
        with contextlib.suppress(Exception):  # dead already; this only frees its handle
            ray.kill(dead, no_restart=True)
        replacement = self.create_actor_fn()
        started = replacement.__ray_ready__.remote()  # Ray's own: answered once it is up

        def join_when_started() -> None:
            # An actor that failed to start (or is still not up) joins anyway: its first
            # message fails and it is replaced in turn, as a dead one is.
            try:
                ray.get(started, timeout=_ACTOR_START_SECONDS)
            except ray.exceptions.GetTimeoutError:
                log.warning(
                    "a replacement Ray actor did not start within %.0f s; its sites wait for it",
                    _ACTOR_START_SECONDS,
                )
            except Exception:  # noqa: BLE001 - a failed start shows at its first message
                pass
            self.pool.append(replacement)  # list.append: atomic beside Flower's threads

        threading.Thread(target=join_when_started, name="actor-replacement", daemon=True).start()
        log.warning("a ClientApp's process died; its Ray actor is replaced by a new one")

    def submit_to_a_live_actor(self: Any, actor_fn: Any, job: Any) -> Any:
        # Flower's ``submit``, except for how the actor is taken: Flower runs one worker
        # thread per actor and pops an idle actor without looking; while a replacement
        # starts there is one actor fewer, so a worker waits here for the first one free
        # (a live one done with its job, or the replacement), taking it under a lock.
        waited = time.monotonic()
        while True:
            with _POOL_LOCK:
                actor = self.pool.pop() if self.pool else None
            if actor is not None:
                break
            if time.monotonic() - waited > 2 * _ACTOR_START_SECONDS:
                # A replacement joins within _ACTOR_START_SECONDS, up or not: an actor
                # lost some other way. Flower answers the site's message with this error.
                raise RuntimeError(f"no Ray actor was free for {2 * _ACTOR_START_SECONDS:.0f} s")
            time.sleep(_POOL_WAIT_SECONDS)
        app_fn, message, cid, context = job
        future = actor_fn(actor, app_fn, message, cid, context)
        self._future_to_actor[future] = actor
        return future

    add_actor_back_to_pool.replaces_dead_actors = True  # type: ignore[attr-defined]
    pool_class.add_actor_back_to_pool = add_actor_back_to_pool
    pool_class.submit = submit_to_a_live_actor


def _actor_died(future: Any) -> bool:
    """Whether a finished job failed because its actor's process is gone."""
    import ray

    try:
        ray.get(future, timeout=0)
    except ray.exceptions.RayActorError:  # ActorDiedError, ActorUnavailableError
        return True
    except Exception:  # the ClientApp raised, or not finished: the actor is fine
        return False
    return False


def keep_ray_on_loopback() -> None:
    """Make the Ray instance this process starts its own one, listening on loopback only.

    Call it before Ray is imported: Ray reads its cluster switch then.
    """
    # Ray takes a node's IP to be the machine's external address, even when told 127.0.0.1
    # (ray.init's _node_ip_address goes through services.resolve_ip_for_localhost), and
    # its gRPC servers (gcs_server, raylet, every worker: the ClientApp actors too) listen
    # on all interfaces unless the node IP is a loopback one. Ray's switch for multi-node
    # clusters, off by default on macOS and Windows where Ray runs on one machine only,
    # makes the node IP the loopback address when off (services.get_node_ip_address): then
    # the gRPC servers and the runtime-env and dashboard agents listen on 127.0.0.1 only.
    # A simulation runs on one machine: no other node ever joins it.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # Without an address, ray.init() joins the Ray instance RAY_ADDRESS names or the one a
    # `ray start` left running (/tmp/ray/ray_current_cluster): processes that are not the
    # simulation's, listening wherever they were told to. "local" starts a new instance.
    os.environ["RAY_ADDRESS"] = "local"


def start_no_idle_worker() -> None:
    """Keep Ray from starting a worker process nobody uses. Call it before Ray is imported.

    When the driver connects, Ray starts an idle worker per CPU in advance. The ClientApp
    actors cannot use it (Flower gives them a runtime environment, and a worker serves one
    environment only), so each simulation started one more Python process for nothing,
    and, Ray starting as many workers at once as there are CPUs, the first actor waited
    for it on a small machine.
    """
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")


class _NoQueryHandlerNoise(logging.Filter):
    """Drop Flower's traceback for a ClientApp that registers no query function.

    The engine asks every site its name with a QUERY (``flplatform.engine.discovery``); a
    user's app need not answer it (its sites are then named by their node ids, and the
    engine says so once). Flower's simulation logs each such refusal as an error with two
    tracebacks, per site per run. Also dropped: the backend's one-line header before any
    ClientApp error, which the error's own record (kept for every other error) repeats.
    """

    _NOISE = (
        "No query function registered with name",
        "An exception was raised when processing a message by RayBackend",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(noise in text for noise in self._NOISE)


def quiet_missing_query_handlers() -> None:
    """Keep Flower's log free of tracebacks for apps without a query function."""
    logging.getLogger("flwr").addFilter(_NoQueryHandlerNoise())


# Seconds between two looks at the owning command: the simulation ends this long at most
# after it (a round being written then is not committed: the ledger checks first).
OWNER_POLL_SECONDS = 0.2
# Flower's processes above the simulation (SuperExec and the SuperLink that started it).
_FLOWER_PARENTS = ("flower-superexec", "flower-superlink")


def end_with_owner() -> None:
    """End the federation once the command that started it is gone (``run.owner``).

    A daemon thread looks every ``OWNER_POLL_SECONDS``; then it SIGKILLs every other
    process of this process's session (SuperExec's: Ray's gcs_server, raylet, agents and
    the ClientApp actors), the Flower processes above it that are still there, and itself.
    Nothing is left to follow the run, and nothing writes to it.
    """
    if named_owner() is None:  # started by hand (`flwr run`): nobody to watch
        return

    def watch() -> None:
        while not owner_gone():
            time.sleep(OWNER_POLL_SECONDS)
        log.warning("the command that started this simulation is gone: ending it")
        end_federation()

    threading.Thread(target=watch, name="flplatform-owner-watch", daemon=True).start()


def end_federation() -> None:
    """SIGKILL this simulation's session, the Flower processes above it, and itself."""
    me, session = os.getpid(), os.getsid(0)
    table = process_table() or {}
    doomed = [pid for pid, proc in table.items() if pid != me and proc.sid == session]
    parent = os.getppid()
    while parent in table and any(name in _cmdline(parent) for name in _FLOWER_PARENTS):
        doomed.append(parent)
        parent = table[parent].ppid
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def main() -> None:
    """``flwr-simulation``, with Ray on loopback only and dead actors replaced, ending
    with the command that started it."""
    keep_ray_on_loopback()
    start_no_idle_worker()
    quiet_missing_query_handlers()
    end_with_owner()
    # Flower's module first: it sets Ray's environment before anything imports Ray.
    flwr_simulation = simulation_entry_point()

    replace_dead_actors()
    flwr_simulation()
