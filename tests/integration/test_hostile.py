"""The hostile-site suite: one real run per attack, against the attacker silent.

Each test judges one run of the attack app (tests/integration/apps/attack_app:
flplatform's ServerApp and the built-in site behind ``clients.attacks.attack_mod``), as
``flplatform run APP -c attack.kind=...`` runs it by hand: digits, the MLP, three sites
(london, ohio, california; Dirichlet α = 0.5), sync, 20 rounds, the platform's site
defaults (2 local epochs, lr 0.1, site momentum 0.9), on the world network's virtual
clock (the app's ``network``). California attacks from round 2; round 1 is honest in
every run. On the virtual clock replies are judged in simulated order, so a run repeats
itself exactly, and an attack whose every update is rejected ends where the silent run
ends; on the wall clock the order replies come in changes a round's sum (and centred
clipping's radius) in the last bits, and twenty rounds of training made that up to 2.3
points between two runs of one seed. The issue's target, per attack:

(a) the honest sites' rounds go on: london and ohio have an ``applied`` update in every
    round from the attack's on, and the run finishes;
(b) the attacker's updates are rejected, or applied with a clip/cap reason, in
    ``history updates`` (the reason wording is guessed loosely, see ``Case.reasons``;
    a scaled update, which clipping holds only where it reaches beyond the honest ones,
    at least three rounds in four);
    ALIE and IPM are built to look like honest updates: their updates must be applied
    every round, so that (c) is judged with the attack counted;
(c) the final accuracy is no more than 2 points below the same run with the attacker
    silent (attack kind ``silent``: no update from round 2 on, the same sites and split).

"Final accuracy" is the mean of the last 3 rounds' accuracy: on digits' 360 test images,
with two non-IID sites left, one round moves the silent run's accuracy by up to 3.6
points (rounds 16-20: 0.908, 0.922, 0.897, 0.919, 0.933), so one round alone would
compare noise. The bound is one-sided: a defence that caps an attacker's weight but
keeps its honest update (``examples``) trains on three sites' data and may beat the
two-site silent run (the honest three-site run ends 2.5 points above it).

The runs are one Flower run, started once for the module: a sweep (the run config's
``sweep`` key, as ``flwr run APP`` takes it) of each federation's silent run (plain;
server momentum 0.9; FetchSGD) and each attack in its federation, every run its own in
the ledger, each member's options and ``attack.*`` keys reaching the sites with its
messages; the tests share one pytest-xdist worker. ``suicide`` runs alone, with the
honest sites in an actor of their own. The sweep takes about a minute on a 2-core
machine, most of it Flower's start-up; a run of 20 rounds, a few seconds.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flplatform.cli.app import app
from flplatform.launch.app_directory import read_app
from flplatform.launch.flower import ACTORS_ENV, start_app
from flplatform.launch.processes import ProcessTree
from storage import LedgerRepository, RoundRecord, RunRecord, UpdateRecord

ATTACK_APP = Path(__file__).parent / "apps" / "attack_app"
# The federation is the app's own (its pyproject.toml), as `flplatform run` runs it by hand.
_DECLARED = read_app(ATTACK_APP).config
ATTACKER = str(_DECLARED["attack.site"])  # california
HONEST = tuple(s for s in str(_DECLARED["sites"]).split(",") if s != ATTACKER)
START_ROUND = int(_DECLARED["attack.round"])  # 2: round 1 is honest (a replay needs it)
ROUNDS = int(_DECLARED["num-server-rounds"])  # 20
FINAL_ROUNDS = 3  # "final accuracy": the mean over these last rounds
MAX_LOSS = 0.02  # accuracy points an attack may cost against the silent run

pytestmark = [pytest.mark.slow, pytest.mark.hostile]
runner = CliRunner()

# The federations the attacks run in (run-config items on top of the attack app's own).
PLAIN: tuple[str, ...] = ()
MOMENTUM = ("server-momentum=0.9",)  # FedAvgM: a float32-max step overflows the momentum
# FetchSGD on a 4 810-parameter model: 500 coordinates a step from a 5 × 2 500 sketch.
FETCHSGD = ("strategy=fetchsgd", "k=500")


@dataclass(frozen=True)
class Case:
    """One attack: its kind, its federation, and the words its ledger reason may use.

    ``reasons`` are guesses at the defence's wording (it is not written yet); one of them
    must appear in the reason of each attacker update that was not plainly rejected.
    """

    kind: str
    federation: tuple[str, ...]
    reasons: tuple[str, ...]
    # Defence options beyond the defaults (the silent run of the federation is unaffected).
    defence: tuple[str, ...] = ()
    scale: float = 0.0  # attack.scale: 0 is the kind's default (clients/attacks.py)
    # (b): "every" attacker update rejected or flagged; "mostly": at least three in four
    # (an update that clipping holds only when it reaches beyond the honest ones); or
    # "none": every one applied (an attack that looks honest, counted)
    flagged: str = "every"

    @property
    def id(self) -> str:
        return f"{self.kind}x{self.scale:g}" if self.scale else self.kind


CASES = [
    Case("huge", PLAIN, ("norm",)),
    # float32's max times √d overflows a float32 norm: "non-finite" if it is computed so.
    Case("float32-max", MOMENTUM, ("norm", "non-finite", "finite")),
    Case("examples", PLAIN, ("examples", "share")),
    Case("replay", PLAIN, ("replay", "identical", "same as", "duplicate")),
    Case("sketch", FETCHSGD, ("norm", "non-finite", "finite")),
    # Same norm as an honest update, by construction: a norm check cannot see it. The
    # guard's direction check can; it is off by default (near a stationary point honest
    # non-IID sites may point anywhere), so this run turns it on. At 0: the flipping site's
    # recent cosines average below 0 every round (-0.70 in round 2, -0.20 by round 20) while
    # single rounds' cosines reach +0.04 from round 15; judged on one round, a flip got in
    # there and the run ended at 0.10.
    Case("sign-flip", PLAIN, ("direction", "cosine"), defence=("update-min-cosine=0",)),
    # The process dies on round 2's message: that update is lost, with the reason why.
    Case("suicide", PLAIN, ("dead", "died", "crash", "killed", "lost", "no reply")),
    # A scaled ×5 update, with the defaults: the guard clips it to the median norm beyond
    # 3×, and centred clipping (local-SGD's default aggregator) counts its offset from the
    # last step at most the median distance; each round's row says which held it. A round
    # where its offset is within the median distance counts it whole, and says nothing.
    Case("scaled", PLAIN, ("norm", "centered-clip"), scale=5, flagged="mostly"),
    # Not here, with the defaults: a ×10 sign flip, clipped to the median norm, is an
    # update of honest size pointing away, which neither clipping sees; it needs the
    # direction check above (benchmarks/bench_hostile.py measures it with the defaults).
    # The published attacks on robust aggregation, given the honest updates of the round.
    Case("alie", PLAIN, (), scale=1, flagged="none"),
    Case("ipm", PLAIN, (), flagged="none"),
]


@dataclass(frozen=True)
class Outcome:
    """What one simulation left in its ledger, and how long it took."""

    run: RunRecord
    rounds: list[RoundRecord]
    updates: list[UpdateRecord]
    ledger_reasons: dict[int, tuple[str, str]]  # attacker's round → (status, reason), via CLI
    wall_seconds: float
    output: str

    @property
    def accuracies(self) -> list[float]:
        return [float(r.metrics.get("accuracy") or 0.0) for r in self.rounds]

    @property
    def final_accuracy(self) -> float:
        """The mean accuracy of the last ``FINAL_ROUNDS`` rounds (0 for a missing round)."""
        tail = self.accuracies[-FINAL_ROUNDS:]
        tail += [0.0] * (FINAL_ROUNDS - len(tail))  # a run that stopped early scores 0
        return sum(tail) / FINAL_ROUNDS


def run_sweep_of(home: Path, cases: list[Case]) -> dict[Case, Outcome | str]:
    """The attack app's runs of ``cases``, each in its own federation, in one Flower run:
    a sweep, started as ``flwr run APP`` starts one (our launcher: a SuperLink on
    127.0.0.1, FLWR_HOME in ``home``); each read back from its ledger, the attacker's rows
    as ``history updates`` shows them.

    The sweep's exit code is not asserted here: an attack may fail its run (that is what
    the tests judge), and its ledger still says what happened; a run that never began is
    the end of the sweep's log instead.
    """
    app_dir = home / "attack_app"
    if not app_dir.exists():  # Flower builds its FAB from the directory: a private copy
        shutil.copytree(ATTACK_APP, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    db = f"sqlite:///{home / 'ledger.db'}"
    members = [
        {
            **_items(case.federation + case.defence),
            "name": " ".join((case.id, *case.federation)),
            "run-tag": f"hostile-{index}",
            "attack.kind": case.kind,
            "attack.scale": float(case.scale),
        }
        for index, case in enumerate(cases)
    ]
    with ProcessTree() as tree:
        process = start_app(
            app_dir,
            home=home,
            log_name="hostile",
            tree=tree,
            run_config={"db": db, "sweep": json.dumps(members)},
            num_sites=len(HONEST) + 1,
        )
        process.run.wait(timeout=900)
    outcomes: dict[Case, Outcome | str] = {}
    with LedgerRepository.open(db) as repo:
        runs = {run.tag: run for run in repo.list_runs()}
        for case, member in zip(cases, members, strict=True):
            run = runs.get(member["run-tag"])
            if run is None:
                outcomes[case] = f"run {case.id} never began:\n{process.log_tail(60)}"
                continue
            rounds, updates = repo.list_rounds(run.id), repo.list_updates(run.id)
            # The attacker's rows as a user reads them: `history updates RUN --site ...`.
            shown = runner.invoke(
                app,
                ["history", "updates", str(run.id), "--site", ATTACKER, "--db", db]
                + ["--format", "json"],
            )
            assert shown.exit_code == 0, shown.output
            reasons = {
                row["round"]: (row["status"], row["reason"] or "")
                for row in json.loads(shown.output)
            }
            outcomes[case] = Outcome(
                run, rounds, updates, reasons, run.wall_seconds or 0.0, process.log_tail(60)
            )
    return outcomes


def _items(items: tuple[str, ...]) -> dict[str, object]:
    """``key=value`` run-config items, each value a number where it reads as one."""
    pairs = dict(item.split("=", 1) for item in items)
    return {key: _number(value) for key, value in pairs.items()}


def _number(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def silent(federation: tuple[str, ...]) -> Case:
    """The run of ``federation`` with the attacker silent: each attack's baseline."""
    return Case("silent", federation, ())


@pytest.fixture(scope="module")
def swept() -> dict[Case, Outcome | str]:
    """Every run of the sweep, by case (filled by ``sweep_runs``, once)."""
    return {}


def sweep_runs(
    cache: dict[Case, Outcome | str], tmp_path_factory: pytest.TempPathFactory
) -> dict[Case, Outcome | str]:
    """Each federation's silent run and every attack but ``suicide``, in one sweep."""
    if not cache:
        home = tmp_path_factory.mktemp("hostile")
        federations = list(dict.fromkeys(c.federation for c in CASES))
        cases = [silent(f) for f in federations] + [c for c in CASES if c.kind != "suicide"]
        with pytest.MonkeyPatch.context() as patch:  # its own home, as flplatform_home gives
            patch.setenv("FLPLATFORM_HOME", str(home))
            patch.setenv("FLWR_HOME", str(home / "flwr"))
            try:
                cache.update(run_sweep_of(home, cases))
            except Exception as exc:  # each later test fails with it, none runs it again
                cache.update({case: f"the sweep failed: {exc!r}" for case in cases})
                raise
        for federation in federations:
            baseline = outcome(cache, silent(federation))
            # The baseline itself must be sound: every round applied both honest sites.
            assert baseline.run.status == "finished", (baseline.run.error, baseline.output)
            assert [r.num_applied for r in baseline.rounds[START_ROUND - 1 :]] == [2] * (
                ROUNDS - START_ROUND + 1
            )
            print(
                f"\nsilent {' '.join(federation) or 'plain'}: final accuracy "
                f"{baseline.final_accuracy:.4f} (last rounds {baseline.accuracies[-5:]}), "
                f"{baseline.wall_seconds:.1f} s"
            )
    return cache


def outcome(runs: dict[Case, Outcome | str], case: Case) -> Outcome:
    """The run of ``case``; the test fails with the sweep's log if it never began."""
    found = runs[case]
    assert isinstance(found, Outcome), found
    return found


@pytest.mark.parametrize(
    "case",
    # On one pytest-xdist worker (`--dist loadgroup`), so that the sweep runs once.
    [pytest.param(c, id=c.id, marks=pytest.mark.xdist_group("hostile")) for c in CASES],
)
def test_an_attacker_cannot_hurt_the_honest_sites(
    case: Case,
    flplatform_home: Path,
    swept: dict[Case, Outcome | str],
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs = sweep_runs(swept, tmp_path_factory)
    baseline = outcome(runs, silent(case.federation))
    if case.kind == "suicide":  # the honest sites train in another actor, as for a user
        monkeypatch.setenv(ACTORS_ENV, "2")
        attacked = outcome(run_sweep_of(flplatform_home, [case]), case)
    else:
        attacked = outcome(runs, case)
    # Recorded for the report whatever the checks below find (run with -s to see it).
    by_round = [round(a, 3) for a in attacked.accuracies]
    shown = {r: (status, reason[:60]) for r, (status, reason) in attacked.ledger_reasons.items()}
    print(
        f"\n{case.id}: final accuracy {attacked.final_accuracy:.4f} against silent "
        f"{baseline.final_accuracy:.4f}; run {attacked.run.status} after "
        f"{len(attacked.rounds)} rounds; {attacked.wall_seconds:.1f} s; accuracy by round "
        f"{by_round}; attacker {shown}"
    )
    # Every target is checked and every miss named at once: (a), (b) and (c) fail for
    # different reasons, and each says what the defence (or the lifecycle) still lacks.
    problems: list[str] = []

    # (a) the honest sites' rounds go on
    if attacked.run.status != "finished" or len(attacked.rounds) != ROUNDS:
        problems.append(
            f"(a) run {attacked.run.status} after {len(attacked.rounds)} of {ROUNDS} rounds: "
            f"{attacked.run.error}"
        )
    applied = {(u.round, u.site) for u in attacked.updates if u.status == "applied"}
    honest_rows = {
        (u.round, u.site): (u.status, (u.reason or "")[:80])
        for u in attacked.updates
        if u.site in HONEST
    }
    missing = [
        (r, site)
        for r in range(START_ROUND, ROUNDS + 1)
        for site in HONEST
        if (r, site) not in applied
    ]
    if missing:
        shown_missing = [(key, honest_rows.get(key, "no row")) for key in missing[:4]]
        problems.append(f"(a) {len(missing)} honest updates not applied: {shown_missing}")

    # (b) the attacker's updates are rejected, or clipped/capped with a reason that says so
    attacks = (
        range(START_ROUND, START_ROUND + 1)  # it dies once; a replaced process is honest
        if case.kind == "suicide"
        else range(START_ROUND, ROUNDS + 1)
    )
    unflagged = {}
    for r in attacks:
        status, reason = attacked.ledger_reasons.get(r, ("absent", ""))
        lost = case.kind == "suicide" and status in ("dropped", "rejected") and reason
        flagged = any(word in reason.lower() for word in case.reasons)
        if not (lost or status == "rejected" or flagged):
            unflagged[r] = (status, reason[:80])
    if (case.flagged == "every" and unflagged) or (
        case.flagged == "mostly" and 4 * len(unflagged) > len(attacks)
    ):
        first = dict(list(unflagged.items())[:3])
        problems.append(
            f"(b) {len(unflagged)} attacker updates neither rejected nor flagged with one of "
            f"{case.reasons}: {first}"
        )
    not_applied = {
        r: attacked.ledger_reasons.get(r, ("absent", ""))
        for r in attacks
        if attacked.ledger_reasons.get(r, ("absent", ""))[0] != "applied"
    }
    if case.flagged == "none" and not_applied:
        problems.append(f"(b) the attack was not counted in every round: {not_applied}")
    # An attack that looks honest must still have been made: had its keys not reached the
    # attacker, it would have trained honestly, and on the virtual clock every such run of
    # the sweep would be the same run.
    lookalikes = [
        c.id
        for c in CASES
        if c != case and c.flagged == "none" and outcome(runs, c).accuracies == attacked.accuracies
    ]
    if case.flagged == "none" and lookalikes:
        problems.append(f"(b) the run is the same as {lookalikes}'s: was the attack made?")

    # (c) the final accuracy is within 2 points of the silent run's
    if attacked.final_accuracy < baseline.final_accuracy - MAX_LOSS:
        problems.append(
            f"(c) final accuracy {attacked.final_accuracy:.4f}, silent "
            f"{baseline.final_accuracy:.4f} (last rounds {by_round[-3:]} against "
            f"{[round(a, 3) for a in baseline.accuracies[-3:]]})"
        )
    assert not problems, "\n".join(problems)
