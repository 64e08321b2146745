"""A small ledger whose run summaries are worked out by hand (see
tests/flplatform/test_comparison.py).

Run 1, simulated on the world network (k-async, K=2, cnn, int8), two sites:

    round  accuracy  ends at (sim s)  training bytes up  down
    1      0.50      10.0             100 + 200 = 300    2000
    2      0.92      25.5             150 +  50 = 200    2000
    3      0.91      40.0             300                1000

plus an evaluation in round 1 (30 B up, 300 B down) and each site's query (7 B up, 5 B
down): every byte of the run is 844 up and 5310 down. London's applied updates had
staleness 0, 1, 2 (mean 1.0), Tokyo's 0, 0 (0.0).

Run 2, on the wall clock, with the sites' accuracy only (created at T0 + 100):

    round  site accuracy  finished at   training bytes up
    1      0.60           T0 + 104.0    40
    2      0.95           T0 + 109.5    60

Run 3, a user's own app: no strategy, sync, model or codec in its config, no accuracy.
Run 4, FetchSGD (k = 250 coordinates per step) in sync mode, no rounds yet.
"""

from __future__ import annotations

from storage import EvaluationInput, LedgerRepository, TrafficInput, UpdateInput

T0 = 1_700_000_000.0


def _update(site: str, rnd: int, *, up: int, staleness: int = 0, t: float) -> UpdateInput:
    return UpdateInput(
        site=site,
        dispatched_round=rnd,
        version_trained_on=rnd - 1 - staleness,
        staleness=staleness,
        bytes_up=up,
        bytes_down=1000,
        status="applied",
        dispatched_at=t,
        arrived_at=t + 0.5,
    )


def write_comparison_ledger(url: str) -> None:
    """Write runs 1 to 4 into the (new) ledger at ``url``."""
    with LedgerRepository.open(url) as repo:
        # ---- run 1: simulated
        run = repo.create_run(
            name="stragglers: k-async K=2",
            strategy="local-sgd",
            seed=4,
            config={"strategy": "local-sgd", "sync": "k-async", "k": 2, "model": "cnn"}
            | {"codec": "int8"},
            num_rounds_planned=3,
            network="world",
            created_at=T0,
        )
        for site in ("london", "tokyo"):
            repo.add_site(run, name=site, node_id=len(site))
        steps = [
            (0.50, 0.0, 10.0, [("london", 100, 0), ("tokyo", 200, 0)]),
            (0.92, 10.0, 25.5, [("london", 150, 1), ("tokyo", 50, 0)]),
            (0.91, 25.5, 40.0, [("london", 300, 2)]),
        ]
        for rnd, (accuracy, start, end, updates) in enumerate(steps, start=1):
            t = T0 + 10 * rnd
            repo.record_round(
                run,
                round=rnd,
                model_version=rnd,
                started_at=t,
                finished_at=t + 1,
                metrics={"accuracy": accuracy, "loss": 1.0 / rnd},
                train_loss=0.5,
                virtual_started_at=start,
                virtual_finished_at=end,
                updates=[_update(s, rnd, up=up, staleness=st, t=t) for s, up, st in updates],
                evaluations=[
                    EvaluationInput(
                        site="london",
                        model_version=1,
                        bytes_up=30,
                        bytes_down=300,
                        status="evaluated",
                        dispatched_at=t,
                        arrived_at=t + 0.5,
                        num_examples=10,
                        loss=0.5,
                        accuracy=0.5,
                    )
                ]
                if rnd == 1
                else [],
            )
        repo.add_traffic(
            run,
            [
                TrafficInput(site=s, kind="query", messages=1, bytes_up=7, bytes_down=5)
                for s in ("london", "tokyo")
            ],
        )
        repo.finish_run(
            run,
            status="finished",
            final_metrics={"accuracy": 0.91},
            finished_at=T0 + 50,
            simulated_seconds=40.0,
        )

        # ---- run 2: wall clock, the sites' accuracy
        run = repo.create_run(
            name="wine, standardised",
            strategy="local-sgd",
            seed=0,
            config={"strategy": "local-sgd", "sync": "sync", "k": 2, "model": "mlp"}
            | {"codec": "none"},
            num_rounds_planned=2,
            created_at=T0 + 100,
        )
        repo.add_site(run, name="london", node_id=1)
        for rnd, (accuracy, end, up) in enumerate([(0.60, 104.0, 40), (0.95, 109.5, 60)], 1):
            repo.record_round(
                run,
                round=rnd,
                model_version=rnd,
                started_at=T0 + end - 3,
                finished_at=T0 + end,
                metrics={"site_accuracy": accuracy, "loss": 1.0},
                train_loss=0.5,
                updates=[_update("london", rnd, up=up, t=T0 + end - 3)],
            )
        repo.finish_run(run, status="finished", finished_at=T0 + 110)

        # ---- run 3: a user's own app
        run = repo.create_run(
            name="my-app",
            strategy="MyFedAvg",
            seed=1,
            config={"learning-rate": 0.01},
            num_rounds_planned=1,
            created_at=T0 + 200,
        )
        repo.record_round(
            run,
            round=1,
            model_version=1,
            started_at=T0 + 201,
            finished_at=T0 + 202,
            metrics={"loss": 0.5},
            train_loss=0.5,
            updates=[],
        )
        repo.finish_run(run, status="finished", finished_at=T0 + 203)

        # ---- run 4: FetchSGD, whose k counts coordinates
        repo.create_run(
            name="fetchsgd",
            strategy="fetchsgd",
            seed=2,
            config={"strategy": "fetchsgd", "sync": "sync", "k": 250, "model": "cnn"},
            num_rounds_planned=5,
            created_at=T0 + 300,
        )
