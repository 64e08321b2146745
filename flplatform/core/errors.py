"""One error hierarchy for the whole platform.

Every error a user can cause (bad configuration, a missing or malformed file, a database
that cannot be opened, a malformed site reply) is an ``FLPlatformError`` carrying a
one-line ``reason`` that says what was wrong and what is allowed, and an ``exit_code``
the CLI returns. This module imports nothing heavy so that ``storage`` (which imports
neither Flower nor torch) can use it.
"""

from __future__ import annotations


class FLPlatformError(Exception):
    """Base of every domain error.

    Parameters
    ----------
    reason : str
        One line naming the problem and what is allowed instead.
    """

    exit_code: int = 1

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ConfigError(FLPlatformError):
    """A configuration value is unknown, out of range or inconsistent."""

    exit_code = 2


class DataError(FLPlatformError):
    """A data file is missing, unreadable or malformed, or a dataset is unavailable."""

    exit_code = 3


class StorageError(FLPlatformError):
    """The ledger database cannot be opened, migrated, read or written."""

    exit_code = 4


class NotFoundError(StorageError):
    """A run (or another ledger object) the user asked for does not exist."""

    exit_code = 5


class FlowerVersionError(FLPlatformError):
    """The installed Flower lacks an internal flplatform relies on
    (``flplatform.core.flower_internals``): it is outside the supported range."""


class UpdateRejected(FLPlatformError):
    """A site's reply is malformed or hostile; the round goes on without it."""

    exit_code = 6


class StepRefused(FLPlatformError):
    """A round's step would make the global model unusable (non-finite); it is not taken.

    Raised by a strategy's ``finish_aggregation`` with its state as before the step. The
    engine keeps the model, and the round's updates are recorded as not applied with the
    reason. ``arrays``: the model to go on with as a new version, for a strategy that makes
    one every round (delayed updates); None keeps the current version.
    """

    exit_code = 6

    def __init__(self, reason: str, arrays: object | None = None) -> None:
        super().__init__(reason)
        self.arrays = arrays


class RunFailed(FLPlatformError):
    """A federated run could not start or stopped before its last round."""

    exit_code = 7


class NoProgress(RunFailed):
    """Several rounds in a row applied no update although replies came back and failed.

    The engine stops the run rather than spend its remaining rounds the same way (for
    example, every site sending a model whose keys do not match the server's), naming the
    reasons.
    """


class HalvesDisagree(RunFailed):
    """No site's reply came from the ClientApp mod the server's strategy needs.

    The strategy's site half (FetchSGD's sketch, the delayed updates' periods) is a mod in
    the site's ``@app.train(mods=[...])``; a site without it sends a whole model the
    server cannot use. When every reply of a round lacked it, the run stops once the round
    is recorded, naming both halves and the fix, instead of rejecting every update until
    the stop rule trips; a single such site is only rejected.
    """


class RunStopped(RunFailed):
    """The user stopped a run with SIGINT (Ctrl-C) or SIGTERM.

    Every process the run had started is stopped, and the run, if it was still going, is
    marked failed with "stopped by the user (SIGINT)". The exit code is the one a shell
    reports for a process that signal ended: 130 for SIGINT, 143 for SIGTERM.
    """

    exit_code = 130

    def __init__(self, reason: str, *, exit_code: int = 130) -> None:
        super().__init__(reason)
        self.exit_code = exit_code
