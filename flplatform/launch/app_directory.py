"""A user's own Flower app directory, run by ``flplatform run`` with the platform's options.

A Flower app directory holds a ``pyproject.toml`` with ``[tool.flwr.app]``: its components
(``serverapp``, ``clientapp``) and its own run-config keys. ``flplatform run APP_DIR``
runs it as ``flwr run APP_DIR`` would, in a local simulation, and adds the platform's
options. They reach the app two ways:

* ``FLPLATFORM_OPTIONS``, a JSON object of :func:`flplatform.start` keyword names to values
  in the environment of the Flower processes: a ServerApp that calls ``flplatform.start``
  takes them over its own arguments (``--rounds`` → ``num_rounds``, ``--sync``, ``--k``,
  ``--network``, ``--seed``, ``--db`` → ``ledger``, ``--max-failed-rounds``, ``--name``;
  and always ``tag`` and ``ledger``, by which the run is followed);
* the app's run-config keys of the same name, where the app declares them
  (``--rounds`` → ``num-server-rounds``, ``--sites`` → ``sites``, ``--strategy`` →
  ``strategy``, ``--model`` → ``model``, ...): this is how the generic ServerApp
  (``flplatform.server_app:app``) and the app's own code see them.

Options the user did not give are not sent: the app's own code decides (except
``required_sites``, the number of SuperNodes the simulation starts). ``-c key=value``
sets the app's own keys, passed through untouched except for the type its declared
default has.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

from clients.catalog import MODELS
from flplatform.core.checks import one_of, require
from flplatform.core.errors import ConfigError
from flplatform.core.flower_internals import app_config_checks
from flplatform.engine.guard import GUARD_OPTIONS, guard_problems
from flplatform.run.options import ConfigValue, option_problem

GENERIC_SERVERAPP = "flplatform.server_app:app"
# Sites when neither --sites, the app's `sites` key nor its federation says (Flower's
# default is 2).
DEFAULT_NUM_SITES = 2


@dataclass(frozen=True)
class FlowerApp:
    """A Flower app directory: its components and the run-config keys it declares."""

    path: Path
    name: str
    serverapp: str
    clientapp: str
    config: dict[str, ConfigValue]  # declared keys (flattened, dotted) → default values
    # The simulated SuperNodes its default federation declares (``options.num-supernodes``
    # in ``[tool.flwr.federations]``, the table apps written before Flower 1.41 have and
    # that ``flwr run`` still reads); None where it declares none.
    num_supernodes: int | None = None

    @property
    def uses_generic_serverapp(self) -> bool:
        """Whether its ServerApp is flplatform's, which reads a RunConfig from the run config."""
        return self.serverapp == GENERIC_SERVERAPP

    def declared(self) -> str:
        """The declared keys, for error messages."""
        return ", ".join(sorted(self.config)) or "none"


def _given(*, key: str | None = "", start: str | None = "") -> Any:
    """A ``RunOverrides`` field, None (not given) by default, and where it goes: ``key`` is
    the app's run-config key it sets where the app declares one, ``start`` the
    ``flplatform.start()`` keyword it sets in ``FLPLATFORM_OPTIONS``; "" means the option's
    own name (kebab-case for a key), None nowhere."""
    return field(default=None, metadata={"key": key, "start": start})


@dataclass(frozen=True)
class RunOverrides:
    """What ``flplatform run`` was given over the app's own choices; None: not given, so
    not sent. Each field's metadata say where it goes (``RUN_CONFIG_KEYS``,
    ``START_KEYWORDS``)."""

    sites: tuple[str, ...] | None = _given(start=None)  # names (the CLI parses a count)
    rounds: int | None = _given(key="num-server-rounds", start="num_rounds")
    network: str | None = _given()
    sync: str | None = _given()
    k: int | None = _given()
    seed: int | None = _given()
    db: str | None = _given(key=None, start=None)  # the ledger, sent on its own (plan_run)
    max_failed_rounds: int | None = _given()
    strategy: str | None = _given(start=None)
    model: str | None = _given(start=None)
    name: str | None = _given()  # the run's name in the ledger
    # The update guard's options (flplatform/engine/guard.py: GUARD_OPTIONS).
    update_norm_ratio: float | None = _given()
    update_norm_action: str | None = _given()
    max_site_share: float | None = _given()
    reject_replays: bool | None = _given()
    update_min_cosine: float | None = _given()
    # How many checkpoints are kept, and where.
    checkpoint_every: int | None = _given()
    keep_checkpoints: int | None = _given()
    checkpoint_dir: str | None = _given()
    run_config: Sequence[str] = ()  # -c key=value, the app's own keys


def _where(part: str) -> dict[str, str]:
    """Option → its run-config key (``part="key"``) or start() keyword (``"start"``)."""
    out = {}
    for f in fields(RunOverrides):
        target = f.metadata.get(part)
        if target is not None:
            out[f.name] = target or (f.name.replace("_", "-") if part == "key" else f.name)
    return out


# Option → the run-config key it also sets when the app declares that key.
RUN_CONFIG_KEYS = _where("key")
# Option → the flplatform.start() keyword it sets (FLPLATFORM_OPTIONS).
START_KEYWORDS = _where("start")


@dataclass(frozen=True)
class AppRun:
    """Everything needed to start and follow one run of a Flower app."""

    app: FlowerApp
    run_config: dict[str, ConfigValue]  # overrides sent with `flwr run --run-config`
    options: dict[str, Any]  # FLPLATFORM_OPTIONS
    site_names: tuple[str, ...]
    db_url: str  # the ledger, password included: this process follows the run in it
    tag: str
    num_rounds: int | None  # known ahead (option or declared key); None: the app decides
    python_path: tuple[Path, ...] = field(default=())  # extra dirs for Flower processes
    # The ledger's password for the ServerApp (a password file: storage.session.
    # detach_password): its URL travels without it.
    password_env: dict[str, str] = field(default_factory=dict)

    @property
    def num_sites(self) -> int:
        """Simulated SuperNodes."""
        return len(self.site_names)

    def environment(self) -> dict[str, str]:
        """The environment variables that carry :attr:`options` and the ledger's password
        to the ServerApp."""
        return {**options_environment(self.options), **self.password_env}


def options_environment(options: Mapping[str, Any]) -> dict[str, str]:
    """``{FLPLATFORM_OPTIONS: json}`` for ``options``, checked as ``start()`` checks them."""
    from flplatform.run.options import options_environment as start_environment  # the engine

    return start_environment(**options)


# ====================================================================== reading the app
def read_app(path: str | Path) -> FlowerApp:
    """Read and check a Flower app directory; raise ``ConfigError`` saying what is wrong."""
    app_dir = Path(path).expanduser()
    if not app_dir.exists():
        raise ConfigError(f"app directory {path} does not exist")
    if not app_dir.is_dir():
        raise ConfigError(f"{path} is not a directory: give a Flower app directory")
    app_dir = app_dir.resolve()
    pyproject = app_dir / "pyproject.toml"
    if not pyproject.is_file():
        raise ConfigError(
            f"{path} has no pyproject.toml: a Flower app directory holds one with a "
            "tool.flwr.app table"
        )
    try:
        data = tomllib.loads(pyproject.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {pyproject}: {exc}") from None
    if not isinstance(data.get("tool", {}).get("flwr", {}).get("app"), dict):
        raise ConfigError(f"{pyproject} has no tool.flwr.app table: not a Flower app directory")
    validate_config, flatten_dict = app_config_checks()

    try:
        with _imports_undone(_component_packages(data), app_dir):
            valid, errors, _warnings = validate_config(data, check_module=True, project_dir=app_dir)
    except Exception as exc:  # Flower's checks raise on some malformed values
        valid, errors = False, [str(exc)]
    if not valid:
        raise ConfigError(f"{pyproject}: {'; '.join(str(e).strip() for e in errors)}")
    app_table = data["tool"]["flwr"]["app"]
    try:
        config = flatten_dict(app_table.get("config", {}))
    except ValueError as exc:
        raise ConfigError(f"{pyproject}: [tool.flwr.app.config]: {exc}") from None
    components = app_table["components"]
    return FlowerApp(
        path=app_dir,
        name=str(data["project"]["name"]),
        serverapp=str(components["serverapp"]),
        clientapp=str(components["clientapp"]),
        config=dict(config),
        num_supernodes=_federation_supernodes(data["tool"]["flwr"], pyproject),
    )


def _federation_supernodes(flwr: Mapping[str, Any], pyproject: Path) -> int | None:
    """``options.num-supernodes`` of the default federation in ``[tool.flwr.federations]``
    (what ``flwr run APP_DIR`` simulates for such an app); None where none is declared."""
    federations = flwr.get("federations")
    if not isinstance(federations, Mapping):
        return None
    default = federations.get("default")
    federation = federations.get(default) if isinstance(default, str) else None
    if not isinstance(federation, Mapping):
        return None
    options = federation.get("options")
    count = options.get("num-supernodes") if isinstance(options, Mapping) else None
    if count is None:
        return None  # a federation of a SuperLink's address, not a simulation
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(
            f"{pyproject}: [tool.flwr.federations.{default}] options.num-supernodes must "
            f"be a whole number >= 1 (the sites simulated), got {count!r}"
        )
    return count


def _component_packages(data: Mapping[str, Any]) -> set[str]:
    """The top-level packages of the app's component references (``pkg`` of
    ``pkg.module:app``), as far as the table says."""
    components = data.get("tool", {}).get("flwr", {}).get("app", {}).get("components")
    if not isinstance(components, dict):
        return set()
    return {
        ref.partition(":")[0].split(".")[0]
        for ref in components.values()
        if isinstance(ref, str) and ref.partition(":")[0]
    }


@contextmanager
def _imports_undone(packages: set[str], app_dir: Path) -> Iterator[None]:
    """Run the block with those of ``packages`` that this directory would not import as
    they are loaded (and every module below them) out of ``sys.modules``; then put back
    exactly what was there.

    Flower checks a component ``pkg.module:app`` with ``find_spec``, which imports ``pkg``:
    a ``pkg`` imported before from elsewhere (another copy of the app, maybe removed since)
    would answer for this directory's, and this one's would stay for the next app of the
    same name. A package loaded from where this directory's path finds it (installed, or
    the user's own import of this app) stays as it is.
    """
    search = [str(app_dir), *sys.path]  # as Flower looks: the app directory first

    def loaded_from_here(name: str) -> bool:
        module = sys.modules.get(name)
        spec = PathFinder.find_spec(name, search)  # a top-level name: imports nothing
        loaded = getattr(module, "__spec__", None)
        return (
            spec is not None
            and loaded is not None
            and spec.origin == loaded.origin
            and list(spec.submodule_search_locations or ())
            == list(loaded.submodule_search_locations or ())
        )

    undone = {name for name in packages if name not in sys.modules or not loaded_from_here(name)}

    def below(name: str) -> bool:
        return name.split(".", 1)[0] in undone

    saved = {name: module for name, module in sys.modules.items() if below(name)}
    for name in saved:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [name for name in sys.modules if below(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


def parse_run_config(app: FlowerApp, items: Sequence[str]) -> dict[str, ConfigValue]:
    """``-c key=value`` items → the app's keys, each value of its declared default's type."""
    out: dict[str, ConfigValue] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"-c {item!r}: expected key=value, e.g. -c learning-rate=0.05")
        if key not in app.config:
            raise ConfigError(
                f"-c {key}: app '{app.name}' declares no run-config key '{key}'; "
                f"its keys: {app.declared()}"
            )
        out[key] = _typed(key, text.strip(), app.config[key])
    return out


def _typed(key: str, text: str, default: ConfigValue, label: str = "") -> ConfigValue:
    """``text`` as the type of ``default`` (Flower keeps the type a key is declared with).

    ``label`` names what set it in error messages (default ``-c <key>``).
    """
    label = label or f"-c {key}"
    unquoted = text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
    if isinstance(default, bool):
        lowered = unquoted.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{label} must be true or false (declared {default!r}), got {text!r}")
    if isinstance(default, int):
        try:
            return int(unquoted)
        except ValueError:
            raise ConfigError(
                f"{label} must be an integer (declared {default!r}), got {text!r}"
            ) from None
    if isinstance(default, float):
        try:
            return float(unquoted)
        except ValueError:
            raise ConfigError(
                f"{label} must be a number (declared {default!r}), got {text!r}"
            ) from None
    return unquoted


# ====================================================================== planning a run
def plan_run(app: FlowerApp, given: RunOverrides, *, tag: str) -> AppRun:
    """Check every option and build the run: overrides, FLPLATFORM_OPTIONS, sites, ledger.

    Raises ``ConfigError`` (or ``StorageError`` for a ledger that cannot be opened) before
    anything starts. The ledger's URL is sent without its password (``AppRun.password_env``).
    """
    from storage.session import detach_password

    _check_home_outside(app)
    overrides = parse_run_config(app, given.run_config)
    for key, instead in (
        ("db", "use --db"),
        ("run-tag", "flplatform run sets it to follow the run"),
        # Each member would be a run of its own, under a tag the command does not follow.
        (
            "sweep",
            "flplatform run follows one run; run a sweep with `flplatform simulate` "
            "(comma-separated values) or `flwr run APP` (the sweep key's JSON list)",
        ),
    ):
        if key in overrides:
            raise ConfigError(f"-c {key}: {instead}")
    values = _checked_values(app, given)
    options: dict[str, Any] = {}
    for name, value in values.items():
        key = RUN_CONFIG_KEYS[name]
        if key in overrides:
            raise ConfigError(
                f"--{name.replace('_', '-')} and -c {key} both set '{key}': give one of them"
            )
        if name in START_KEYWORDS:
            options[START_KEYWORDS[name]] = value
        if key in app.config:
            text = ",".join(value) if isinstance(value, tuple) else value
            # As the app declares it (an app may spell a number as text).
            overrides[key] = (
                text
                if type(text) is type(app.config[key])
                else _typed(key, str(text), app.config[key], f"--{name.replace('_', '-')}")
            )
        elif name in ("strategy", "model"):
            raise ConfigError(
                f"--{name} sets the app's '{key}' run-config key, which app '{app.name}' does "
                f"not declare (its ServerApp {app.serverapp} picks its own); "
                f"its keys: {app.declared()}"
            )
    sites = values.get("sites")
    if not isinstance(sites, tuple):
        sites = _declared_sites(app, overrides)
    # The simulation starts one SuperNode per site: the engine waits for them all, and a K
    # set in the app's own code beyond them is refused at once rather than waited out.
    options["required_sites"] = len(sites)
    if "sync" in values and "k" in values:  # otherwise the app's own start() call decides
        from flplatform.engine.synchrony import k_sites_problem

        require(k_sites_problem(values["sync"], values["k"], len(sites)))
    db_url = _ledger_url(given.db)
    ledger, password_env = detach_password(db_url)
    options["ledger"] = ledger
    options["tag"] = tag
    options["launched_by"] = launch_record(app, given)
    for key, value in (("db", ledger), ("run-tag", tag)):
        if key in app.config:
            overrides[key] = value
    if app.uses_generic_serverapp:
        _check_generic(app, overrides)
    rounds = overrides.get("num-server-rounds", app.config.get("num-server-rounds"))
    num_rounds = values.get("rounds")
    if num_rounds is None and isinstance(rounds, int) and not isinstance(rounds, bool):
        num_rounds = rounds
    return AppRun(
        app=app,
        run_config=overrides,
        options=options,
        site_names=sites,
        db_url=db_url,
        tag=tag,
        num_rounds=num_rounds if isinstance(num_rounds, int) else None,
        python_path=_python_path(given.model),
        password_env=password_env,
    )


# ====================================================================== launching it again
def launch_record(app: FlowerApp, given: RunOverrides) -> dict[str, Any]:
    """How ``flplatform run`` launched a run, recorded with it (``start``'s ``launched_by``).

    The app directory, the directory the command ran in (relative paths in the options, a
    network profile or a model module found there, mean what they meant then) and the
    options the user gave, as JSON values; never the ledger's URL, which may hold a
    password (``flplatform resume`` is told where the ledger is).
    """
    options: dict[str, Any] = {}
    for f in fields(given):
        value = getattr(given, f.name)
        if f.name == "db" or value is None or (f.name == "run_config" and not value):
            continue
        options[f.name] = list(value) if isinstance(value, tuple | list) else value
    return {"app": str(app.path), "cwd": os.getcwd(), "options": options}


def relaunch(launch: Any, *, run_id: int, db: str | None, tag: str) -> AppRun:
    """The run a recorded ``launch_record`` describes, planned again to resume ``run_id``
    (in the ledger ``db``; None: the default ledger).

    The app directory is read and every option checked again, as ``flplatform run`` did;
    ``ConfigError`` says what no longer holds (the directory moved, say).
    """
    where = f"run {run_id}'s recorded launch ('flplatform-run' in its config)"
    if not isinstance(launch, Mapping) or not isinstance(launch.get("app"), str):
        raise ConfigError(f"{where} names no app directory; it cannot be launched again")
    recorded = launch.get("options", {})
    known = {f.name for f in fields(RunOverrides)} - {"db"}
    if not isinstance(recorded, Mapping) or not set(recorded) <= known:
        unknown = sorted(set(recorded) - known) if isinstance(recorded, Mapping) else recorded
        raise ConfigError(f"{where} holds options this version does not know: {unknown}")
    values: dict[str, Any] = {}
    for name, value in recorded.items():
        if not _of_recorded_type(name, value):
            raise ConfigError(f"{where}: option '{name}' has a value of the wrong type: {value!r}")
        values[name] = tuple(value) if isinstance(value, list) else value
    # The ledger as the resuming command means it (a relative path, the default ledger),
    # before the options are read from the directory the run was started in.
    given = RunOverrides(**values, db=_ledger_url(db))  # plan_run checks each value
    cwd = launch.get("cwd")
    if not isinstance(cwd, str) or not Path(cwd).is_dir():
        raise ConfigError(
            f"{where}: the directory it was started from, {cwd!r}, is gone; relative paths in "
            "its options would mean something else now"
        )
    with contextlib.chdir(cwd):
        plan = plan_run(read_app(launch["app"]), given, tag=tag)
    return replace(plan, options={**plan.options, "resume_run": run_id})


def _of_recorded_type(name: str, value: Any) -> bool:
    """Whether a recorded option has its ``RunOverrides`` field's type (JSON spelling)."""
    kind = {f.name: str(f.type) for f in fields(RunOverrides)}[name]
    if kind.startswith(("tuple", "Sequence")):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if isinstance(value, bool):
        return kind.startswith("bool")
    if isinstance(value, int):
        return kind.startswith(("int", "float"))
    if isinstance(value, float):
        return kind.startswith("float")
    return isinstance(value, str) and kind.startswith("str")


def _check_home_outside(app: FlowerApp) -> None:
    """Refuse a platform home inside the app directory: Flower would pack it into the app.

    ``flwr run`` packs the app directory's ``.py``, ``.toml``, ``.json``… files into the app
    it sends, and Flower's home (``FLWR_HOME``, ``$FLPLATFORM_HOME/flwr`` for our runs) is
    where it installs apps and we write run configs: each run would carry the last one's
    copies, until the app exceeds Flower's size limit.
    """
    from storage.session import flplatform_home

    home = flplatform_home().resolve()
    if home.is_relative_to(app.path):
        raise ConfigError(
            f"FLPLATFORM_HOME {home} (which holds Flower's home, FLWR_HOME, and the run "
            f"logs) lies inside the app directory {app.path}, which flwr run packs into the "
            "app: set FLPLATFORM_HOME to a directory outside it (unset, it is .flplatform in "
            "the current directory)"
        )


def _checked_values(app: FlowerApp, given: RunOverrides) -> dict[str, Any]:
    """The options given, each checked; sites as names, network as a preset or full path."""
    from flplatform.engine.synchrony import SYNC_MODES, synchrony_problems

    out: dict[str, Any] = {}
    if given.sites is not None:
        if not given.sites:
            raise ConfigError("--sites must be a positive count or a list of names")
        out["sites"] = _checked_sites(list(given.sites))
    # Checked by start()'s own rule for each (flplatform/run/options.py), named as given.
    counts = ("rounds", "seed", "max_failed_rounds", "k", "checkpoint_every", "keep_checkpoints")
    require(
        option_problem(START_KEYWORDS[name], getattr(given, name), f"--{name.replace('_', '-')}")
        for name in counts
        if getattr(given, name) is not None
    )
    out.update((name, getattr(given, name)) for name in counts if getattr(given, name) is not None)
    if given.sync is not None:
        sync = given.sync.strip()
        require(one_of(sync, "--sync", SYNC_MODES))
        problems = synchrony_problems(
            sync,
            k=given.k if given.k is not None else 2,
            staleness_bound=-1,
            weighting="",
            adasync=False,
            concurrency=0,
        )
        require(problems)
        out["sync"] = sync
    if given.network is not None:
        out["network"] = _checked_network(given.network, seed=given.seed or 0)
    if given.checkpoint_dir is not None:
        # The ServerApp runs in another directory: a relative path would land there.
        out["checkpoint_dir"] = (
            str(Path(given.checkpoint_dir).expanduser().resolve())
            if given.checkpoint_dir.strip()
            else ""
        )
    if given.strategy is not None:
        strategy = given.strategy.strip()
        if not strategy:
            raise ConfigError("--strategy must not be empty")
        out["strategy"] = strategy
    if given.model is not None:
        out["model"] = _checked_model(app, given.model.strip())
    if given.name is not None:
        name = given.name.strip()
        if not name:
            raise ConfigError("--name must not be empty (unset, the run is named by its app)")
        out["name"] = name
    guard = {name: getattr(given, name) for name in GUARD_OPTIONS}
    guard = {name: value for name, value in guard.items() if value is not None}
    require(guard_problems(**guard))
    out.update(guard)
    return out


def _checked_network(spec: str, *, seed: int) -> str:
    """A preset name as is, a profile file as an absolute path; loaded once to check it."""
    from flplatform.network import load_network

    text = spec.strip()
    if not text:
        return ""
    if text.endswith(".toml") or "/" in text or Path(text).is_file():
        text = str(Path(text).expanduser().resolve())
    load_network(text, seed=seed)  # a bad preset or profile fails here, in one line
    return text


@contextmanager
def _importable_from(directory: Path) -> Iterator[None]:
    """Modules of the app directory importable (as Flower's processes will find them)."""
    entry = str(directory)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _checked_model(app: FlowerApp, model: str) -> str:
    """A built-in name, or a MODULE:FACTORY spec importable from the app dir or Python path."""
    if model in MODELS:
        return model
    if ":" not in model:
        raise ConfigError(
            f"unknown --model '{model}'; allowed: {', '.join(MODELS)}, or MODULE:FACTORY "
            "(a zero-argument callable returning a torch.nn.Module)"
        )
    from clients.models import instantiate_model_spec

    with _importable_from(app.path):
        instantiate_model_spec(model)
    return model


def _python_path(model: str | None) -> tuple[Path, ...]:
    """Where Flower's processes must look for a model spec's module found in the cwd."""
    if model is None or ":" not in model:
        return ()
    from clients.models import model_import_dir

    directory = model_import_dir(model.strip())
    return (directory,) if directory is not None else ()


def _checked_sites(names: object) -> tuple[str, ...]:
    """A count or names, read as the generic ServerApp reads its run config's ``sites``."""
    from flplatform.app.config import as_site_names

    return as_site_names("--sites", names)


def _declared_sites(app: FlowerApp, overrides: Mapping[str, ConfigValue]) -> tuple[str, ...]:
    """Sites from the app's `sites` key (as overridden), else as many as its federation
    declares, else the default count."""
    declared = overrides.get("sites", app.config.get("sites"))
    if declared is not None and str(declared).strip():
        names = _checked_sites(declared)
        if names:
            return names
    if app.uses_generic_serverapp:  # it waits for one node per name in RunConfig.sites
        from flplatform.app.config import DEFAULT_SITES

        return DEFAULT_SITES
    count = app.num_supernodes if app.num_supernodes is not None else DEFAULT_NUM_SITES
    return tuple(f"site-{i + 1}" for i in range(count))


def _ledger_url(db: str | None) -> str:
    """The ledger's absolute URL, opened (created if needed) and checked writable, now."""
    from storage import LedgerRepository
    from storage.session import default_db_url, normalize_db_url

    # An empty --db is refused (normalize_db_url), not taken for the default ledger.
    url = normalize_db_url(db) if db is not None else default_db_url()
    with LedgerRepository.open(url if db is not None else None) as repository:
        repository.check_writable()
    return url


def _check_generic(app: FlowerApp, overrides: Mapping[str, ConfigValue]) -> None:
    """flplatform's ServerApp parses the fused run config: do it now, in one line."""
    from flplatform.app.config import RunConfig

    fused = {**app.config, **overrides}
    with _importable_from(app.path):
        RunConfig.from_mapping(fused, allow_unknown=True)
