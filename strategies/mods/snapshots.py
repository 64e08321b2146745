"""Site snapshots: a mod's state as it was after each piece of work, on the site's own disk.

Our engine numbers the training messages it sends each site (``site-work`` = n, 1, 2, ...)
and names the run with a key that survives a resume (``run-key``). A site handling work n
must act with exactly the state it had after work n − 1 of that run, so that a resumed run
repeats the uninterrupted one bit for bit:

* normally the site's newest snapshot holds it, and ``context.state`` only the tag of the
  work that wrote it (``keys.WORK_TAGS``): a tag below n names the site's latest state.
  The state itself stays out of ``context.state``, which Flower copies to the process
  handling each message and back (a simulation's Ray actor, a deployment's ClientApp
  process): at 10M parameters a DTS site's state is about 200 MB, copied twice per call.
  A process keeps the last state it read or wrote per site and key (``_RECENT``), so a
  simulation's actor reads it from memory; a new process reads the file;
* a resumed run is a new Flower run (``context.state`` starts empty), and a server may
  re-send work the site already did: then the state comes from the newest snapshot of a
  work below n. Work that wrote no state (a training that failed, Sketched-SGD's values
  round, a message lost on the way) changed nothing, so the newest earlier snapshot is
  the state after n − 1.

After work n changes a state, it is written as snapshot n (owner-only, atomic;
``flplatform.core.checkpoint.write_state``) and the newest ``KEEP`` are kept: a resume re-sends
at most the work in flight at the last committed round, a step or two behind. Receiving
work n rewinds the site: snapshots of work n or later belong to a timeline the server
abandoned and are deleted, so a failure of the repeated work cannot leave a stale one.
When neither holds the state (snapshots deleted, a fresh machine), the mod is told None
and its existing state-lost path runs: the server resyncs the site.

A message without ``site-work`` and ``run-key`` (a server that is not ours, Flower's own
strategies), a site without a stable id, or a snapshot that could not be written keeps
the state in ``context.state`` itself.

Where: node config ``state-dir``, else ``$FLPLATFORM_SITE_STATE``, else
``$FLPLATFORM_HOME/site-state``, else ``~/.flplatform/site-state``; then
``<run key>/<site>/<state key>/work-<n>.npz``. The site is its name (node config
``site-name``), else its partition (``partition-<id>``), never the Flower node id, which a
resume changes; a site with neither keeps snapshots only under a ``state-dir`` of its own.
Run keys and site names come from the network and are made safe for a path first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message

from flplatform.core import keys
from flplatform.core.checkpoint import CheckpointError, read_state, write_state
from flplatform.core.errors import ConfigError
from flplatform.core.files import make_private_dirs
from flplatform.core.processes import pid_alive
from strategies.mods.contract import ModState, round_config

log = logging.getLogger("flplatform.strategies.mods.snapshots")

KEEP = 4  # snapshots kept per site and state
KIND = "flplatform-site-snapshot"
_FILE = re.compile(r"work-(\d{9,})\.npz")
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_RUN_KEY_TAG = "run-key"  # in the WORK_TAGS record: the run its tags belong to
# In the WORK_TAGS record, after a state key: the write that made its snapshot, a random
# token also in the file. A site acts on a snapshot only if it wrote it: two nodes under
# one site name and state directory would otherwise read each other's state every call.
_WRITER = "#writer"


@dataclass(frozen=True)
class Work:
    """A training message's place in its run: the run's key and the site's work index."""

    run_key: str
    index: int  # 1-based: the n-th training message sent to this site in this run


def work_of(msg: Message) -> Work | None:
    """The message's (``run-key``, ``site-work``); None unless it carries both.

    An empty run key is none (an engine without a run to resume). A present but
    malformed value is a ``ConfigError``: our engine never sends one.
    """
    config = round_config(msg)
    index, run_key = config.get(keys.SITE_WORK), config.get(keys.RUN_KEY)
    if index is None or run_key is None or run_key == "":
        return None
    if isinstance(index, bool) or not isinstance(index, int) or index < 1:
        raise ConfigError(f"round config '{keys.SITE_WORK}' must be an integer >= 1, got {index!r}")
    if not isinstance(run_key, str):
        raise ConfigError(f"round config '{keys.RUN_KEY}' must be a string, got {run_key!r}")
    return Work(run_key, index)


# ============================================================ the state a mod sees
def load_state(msg: Message, context: Context, key: str) -> ModState | None:
    """The state under ``key`` as it was after the work before ``msg``'s; None if unknown.

    None is what ``ModState.load`` gives a site that never held the state or lost it, so
    the mod's own first-message and state-lost paths apply unchanged.
    """
    work = work_of(msg)
    if work is None:
        return ModState.load(context, key)
    held = held_work(context, key, work.run_key)
    store = SiteSnapshots.of(context, work.run_key)
    if held is not None and held < work.index:  # the normal case: the state after the last work
        if store is not None:
            # A snapshot of a later work is one whose reply never left (Flower kept the
            # context of before): it must not pass for a later state on a resume.
            store.forget_from(key, held + 1)
        if key in context.state:  # kept there: its snapshot could not be written
            return ModState.load(context, key)
        if store is None:
            return None
        recent = store.read(key, held, writer=_writer(context, key))
        if recent is None:
            # Gone, unreadable or another node's: lost, as on a fresh machine, and every
            # older snapshot with it, so that none passes for the state later on.
            store.forget_from(key, 0)
            _hold(context, key, work.run_key, None)
            return None
        return recent[0]
    # A new Flower run (resumed) or work the site did already (re-sent): from the disk.
    found = None
    if store is not None and work.index > 1:
        found = store.latest_before(key, work.index)
    if store is not None:
        store.forget_from(key, work.index)
    _hold(context, key, work.run_key, found)
    return found[0] if found is not None else None


def save_state(msg: Message, context: Context, key: str, state: ModState) -> None:
    """Keep ``state`` under ``key``: for our engine's work as its snapshot on disk (with
    its tag in ``context.state``), otherwise in ``context.state``.

    The process remembers the snapshot's arrays as they are: the mod must not change them
    afterwards (a mod computes each new state into new arrays).
    """
    work = work_of(msg)
    store = SiteSnapshots.of(context, work.run_key) if work is not None else None
    if work is None or store is None:
        state.save(context, key)
        if work is not None:
            _tag(context, key, work.run_key, work.index, "")
        return
    writer = secrets.token_hex(8)
    try:
        store.write(key, work.index, state, writer=writer)
    except (CheckpointError, OSError) as exc:
        # The reply is still good; only a resume needs the snapshot. Without it the newest
        # earlier one would pass for the state after this work, so none may stay; the
        # state stays in context.state instead.
        log.warning("cannot snapshot this site's state (%s); a resume will resync it", exc)
        store.forget_from(key, 0)
        state.save(context, key)
        writer = ""
    else:
        if key in context.state:
            del context.state[key]
    _tag(context, key, work.run_key, work.index, writer)


def held_work(context: Context, key: str, run_key: str) -> int | None:
    """The work after which the site's state under ``key`` was kept for ``run_key`` (its
    snapshot, or ``context.state`` itself), as ``context.state``'s tags say; None if none."""
    tags = context.state.config_records.get(keys.WORK_TAGS)
    if tags is None or tags.get(_RUN_KEY_TAG) != run_key:
        return None
    index = tags.get(key)
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def _tag(context: Context, key: str, run_key: str, index: int, writer: str) -> None:
    """Say in ``context.state`` that the state under ``key`` is work ``index``'s, and which
    write made its snapshot (``writer``; "" when the state is in ``context.state``)."""
    tags = context.state.config_records.get(keys.WORK_TAGS)
    kept = dict(tags) if tags is not None and tags.get(_RUN_KEY_TAG) == run_key else {}
    context.state[keys.WORK_TAGS] = ConfigRecord(
        {**kept, _RUN_KEY_TAG: run_key, key: index, key + _WRITER: writer}
    )


def _writer(context: Context, key: str) -> str | None:
    tags = context.state.config_records.get(keys.WORK_TAGS)
    writer = None if tags is None else tags.get(key + _WRITER)
    return writer if isinstance(writer, str) and writer else None


def _untag(context: Context, key: str) -> None:
    tags = context.state.config_records.get(keys.WORK_TAGS)
    if tags is not None and key in tags:
        gone = (key, key + _WRITER)
        context.state[keys.WORK_TAGS] = ConfigRecord(
            {k: v for k, v in tags.items() if k not in gone}
        )


def _hold(
    context: Context, key: str, run_key: str, found: tuple[ModState, int, str | None] | None
) -> None:
    """Make ``context.state`` say what the site now has under ``key``: the snapshot it was
    restored from (state, work, writer), or nothing."""
    if key in context.state:
        del context.state[key]
    if found is None:
        _untag(context, key)
    else:
        _tag(context, key, run_key, found[1], found[2] or "")


# ================================================================== the files
# a snapshot being written: ``write_state``'s temporary file, named by its process
_TEMPORARY = re.compile(r"\.work-\d+\.npz\.(\d+)\.tmp")


def _remove_abandoned(folder: Path) -> None:
    """Delete the temporary files of writers that died mid-write (killed, out of memory):
    each is up to a snapshot's size, and another is left at every such death. A live
    process's, this one's included, is being written and stays."""
    for entry in folder.iterdir():
        match = _TEMPORARY.fullmatch(entry.name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        try:
            entry.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot delete an abandoned snapshot file %s: %s", entry, exc)


def state_root(node_config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Path:
    """The directory holding this site's snapshots of every run (see the module's doc).

    ``environ``: the site process's environment (default: this process's).
    """
    env = os.environ if environ is None else environ
    configured = node_config.get(keys.STATE_DIR)
    if configured:
        return Path(str(configured)).expanduser()
    if env.get("FLPLATFORM_SITE_STATE"):
        return Path(env["FLPLATFORM_SITE_STATE"]).expanduser()
    if env.get("FLPLATFORM_HOME"):
        return Path(env["FLPLATFORM_HOME"]).expanduser() / "site-state"
    return Path.home() / ".flplatform" / "site-state"


def stable_site_id(node_config: Mapping[str, Any]) -> str | None:
    """What names this site across runs and resumes: its name, else its partition.

    None when the node config has neither: the Flower node id changes on a resume, so it
    would find no snapshot; such a site keeps snapshots only in a ``state-dir`` of its own.
    """
    name = node_config.get(keys.SITE_NAME)
    if name not in (None, ""):
        return str(name)
    partition = node_config.get(keys.PARTITION_ID)
    if partition not in (None, ""):
        return f"partition-{partition}"
    return "site" if node_config.get(keys.STATE_DIR) else None


def safe_name(text: str) -> str:
    """``text`` as one path component that cannot leave its directory.

    Plain names stay readable; anything else (``..``, slashes, spaces, long names) becomes
    ``h-`` and a hash of it, so two different texts never share a directory.
    """
    if _SAFE.fullmatch(text) and text not in (".", ".."):
        return text
    return "h-" + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def forget_run(
    run_key: str,
    node_config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Delete every site's snapshots of ``run_key`` under the sites' state root
    (``state_root`` of ``node_config`` in the sites' environment ``environ``).

    A finished run cannot be resumed, so its snapshots only take disk (a 10M-parameter
    Sketched-SGD site keeps about 480 MB of them). Simulated sites share the machine and
    its state root: ``flplatform simulate`` forgets a run's snapshots when it finishes. A
    deployed site keeps its own (a site cannot tell that a run finished).
    """
    if not run_key:
        return
    root = state_root(node_config or {}, environ)
    shutil.rmtree(root / safe_name(run_key), ignore_errors=True)


class SiteSnapshots:
    """One site's snapshots of one run: ``<root>/<run key>/<site>/<state key>/work-<n>.npz``."""

    def __init__(self, directory: Path, *, keep: int = KEEP) -> None:
        self.directory = directory
        self.keep = keep

    @classmethod
    def of(cls, context: Context, run_key: str) -> SiteSnapshots | None:
        """This site's snapshots of ``run_key``; None when the site has no stable id."""
        site = stable_site_id(context.node_config)
        if site is None:
            return None
        root = state_root(context.node_config)
        return cls(root / safe_name(run_key) / safe_name(site))

    def path(self, key: str, index: int) -> Path:
        return self.directory / safe_name(key) / f"work-{index:09d}.npz"

    def works(self, key: str) -> list[int]:
        """The works that have a snapshot of ``key``, oldest first."""
        folder = self.directory / safe_name(key)
        if not folder.is_dir():
            return []
        found = (_FILE.fullmatch(entry.name) for entry in folder.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def write(self, key: str, index: int, state: ModState, *, writer: str = "") -> int:
        """Write ``state`` as work ``index``'s snapshot, keep the newest; return its bytes.

        ``writer``: a token of this write, kept in the file (``read`` can require it).
        """
        tree = {
            "kind": KIND,
            "state-key": key,
            "work": index,
            "writer": writer,
            "meta": dict(state.meta),
            # np.asarray: a 0-d step may be a NumPy scalar, which would be saved as a float
            "groups": {
                group: {name: np.asarray(array) for name, array in arrays.items()}
                for group, arrays in state.groups.items()
            },
        }
        path = self.path(key, index)
        make_private_dirs(path.parent)
        size = write_state(path, tree)
        _remember(path, state, writer)
        for old in self.works(key)[: -self.keep]:
            try:  # the new snapshot is in place: an old one left over costs only disk
                self.path(key, old).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot delete site snapshot %s: %s", self.path(key, old), exc)
        _remove_abandoned(path.parent)
        return size

    def read(
        self, key: str, work: int, *, writer: str | None = None
    ) -> tuple[ModState, str | None] | None:
        """The snapshot of ``key`` after ``work`` and its writer: from this process's memory
        when it is the one it last read or wrote, else from the file; None when missing,
        unusable, or (given ``writer``) written by another.

        The state's arrays are read-only, from the memory as from the file: a mod computes
        its new state into new arrays (``ModState.load`` gives read-only views too).
        """
        path = self.path(key, work)
        recent = _recalled(path)
        if recent is None:
            try:
                tree = read_state(path)
                state = _state_from_tree(tree, key, work)
            except CheckpointError as exc:
                if path.exists():
                    log.warning(
                        "site snapshot %s is unusable, state treated as lost: %s", path, exc
                    )
                return None
            found = str(tree.get("writer") or "") or None
            recent = (_copy(_remember(path, state, found or "")), found)
        if writer is not None and recent[1] != writer:
            log.warning("site snapshot %s was written by another node: state treated as lost", path)
            return None
        return recent

    def latest_before(self, key: str, index: int) -> tuple[ModState, int, str | None] | None:
        """The newest snapshot of ``key`` from a work before ``index``, and that work (0: none).

        An unreadable newest snapshot is lost state, never a reason to use an older one
        (that would be the wrong state, silently).
        """
        earlier = [n for n in self.works(key) if n < index]
        if not earlier:
            return None
        work = earlier[-1]
        found = self.read(key, work)
        return (found[0], work, found[1]) if found is not None else None

    def forget_from(self, key: str, index: int) -> None:
        """Delete snapshots of work ``index`` and later: the server is redoing that work."""
        for work in self.works(key):
            if work >= index:
                try:
                    self.path(key, work).unlink(missing_ok=True)
                except OSError as exc:  # unreadable later: lost state, never a wrong one
                    log.warning("cannot delete site snapshot %s: %s", self.path(key, work), exc)


# The state each snapshot directory (a site's state key) last had in this process: its
# file, the file's identity when it was written or read, and the state, arrays read-only.
# A file is never changed once written (write_state replaces it whole), so a file of the
# same identity holds the same state; anything else is read from the disk. The least
# recently used go first beyond RECENT_BYTES: a simulation's actor serves many sites, and
# a site it no longer holds costs one read of its file (from the page cache, as a rule).
RECENT_BYTES = 1 << 30
_RECENT: OrderedDict[Path, tuple[Path, tuple[int, int, int], ModState, str]] = OrderedDict()


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _copy(state: ModState) -> ModState:
    """New dictionaries over the same read-only arrays: a mod may change the dictionaries
    it is given, never what this process remembers."""
    return ModState(dict(state.meta), {g: dict(arrays) for g, arrays in state.groups.items()})


def _remember(path: Path, state: ModState, writer: str) -> ModState:
    """Remember ``state`` as ``path``'s (written by ``writer``); return it, arrays read-only."""
    kept = ModState(
        dict(state.meta),
        {
            group: {name: _read_only(np.asarray(a)) for name, a in arrays.items()}
            for group, arrays in state.groups.items()
        },
    )
    identity = _identity(path)
    if identity is None:
        _RECENT.pop(path.parent, None)
        return kept
    _RECENT[path.parent] = (path, identity, kept, writer)
    _RECENT.move_to_end(path.parent)
    total = sum(_nbytes(entry[2]) for entry in _RECENT.values())
    while total > RECENT_BYTES and len(_RECENT) > 1:
        _, (_, _, dropped, _) = _RECENT.popitem(last=False)
        total -= _nbytes(dropped)
    return kept


def _nbytes(state: ModState) -> int:
    return sum(a.nbytes for arrays in state.groups.values() for a in arrays.values())


def _recalled(path: Path) -> tuple[ModState, str | None] | None:
    recent = _RECENT.get(path.parent)
    if recent is None or recent[0] != path:
        return None
    if _identity(path) != recent[1]:
        del _RECENT[path.parent]
        return None
    _RECENT.move_to_end(path.parent)
    return _copy(recent[2]), recent[3] or None


def _state_from_tree(tree: Mapping[str, Any], key: str, work: int) -> ModState:
    """A ``ModState`` from a snapshot's tree, checked (``CheckpointError`` says what is wrong)."""
    if tree.get("kind") != KIND or tree.get("state-key") != key or tree.get("work") != work:
        raise CheckpointError(f"not the snapshot of '{key}' after work {work}")
    meta, groups = tree.get("meta"), tree.get("groups")
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
        for k, v in meta.items()
    ):
        raise CheckpointError("its 'meta' must map names to integers")
    if not isinstance(groups, dict) or not all(
        isinstance(g, str)
        and isinstance(arrays, dict)
        and all(isinstance(n, str) and isinstance(a, np.ndarray) for n, a in arrays.items())
        for g, arrays in groups.items()
    ):
        raise CheckpointError("its 'groups' must map names to named arrays")
    return ModState(dict(meta), {g: dict(arrays) for g, arrays in groups.items()})
