"""The built-in ClientApp is an ordinary Flower app: a plain train function plus a mod."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What a site process must not load: the server engine, the run configuration (which
# loads the engine), the ledger, and the strategies' server classes.
SERVER_MODULES = (
    "flplatform.engine",
    "flplatform.app.config",
    "flplatform.run.start",
    "flplatform.app.federation",
    "storage",
    "sqlalchemy",
    "strategies.local_sgd",
    "strategies.delayed",
    "strategies.fetchsgd",
    "strategies.sketched_sgd",
)


def test_loading_a_site_imports_no_server_code() -> None:
    code = "import json, sys\nimport clients.client_app\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = json.loads(out.stdout)
    assert "strategies.mods" in loaded and "clients.site" in loaded
    server = [m for m in loaded if m.startswith(SERVER_MODULES)]
    assert server == []


def test_the_apps_train_runs_the_algorithm_the_server_names(task_identity: None) -> None:
    """Flower's own dispatch of the app: a delayed-update message gets a period step back."""
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

    from clients import client_app
    from clients.site import load_site
    from flplatform.core import keys

    run_config = {"dataset": "digits", "model": "mlp", "seed": 0}
    node_config = {keys.PARTITION_ID: 0, keys.NUM_PARTITIONS: 2}
    site = load_site(node_config, run_config)
    model = site.build_model(num_classes=10, seed=0)
    from flwr.app import ArrayRecord

    config = ConfigRecord(
        {
            keys.SITE_ALGORITHM: keys.DELAYED,
            keys.SERVER_ROUND: 1,
            keys.MODEL_VERSION: 0,
            keys.INCLUDED_PERIODS: [],
            keys.LOCAL_STEPS: 2,
        }
    )
    msg = Message(
        RecordDict({keys.ARRAYS: ArrayRecord(model.state_dict()), keys.CONFIG: config}),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )
    context = Context(
        run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config=run_config
    )
    reply = client_app.app(msg, context)
    assert not reply.has_error(), reply.error
    assert reply.content[keys.METRICS][keys.PERIOD] == 1
    assert reply.content[keys.CONFIG][keys.UPDATE_KIND] == keys.DELTA
    assert keys.DELAYED_STATE in context.state


def test_a_message_run_config_chooses_the_data_the_site_loads(task_identity: None) -> None:
    """A sweep's run tells the shared sites its own data keys: they win over the node's."""
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

    from clients import client_app
    from clients.site import load_site, run_config_of
    from flplatform.core import keys

    node_config = {keys.PARTITION_ID: 1, keys.NUM_PARTITIONS: 3}
    own = {"dataset": "digits", "model": "mlp", "seed": 0, "alpha": 0.5}
    context = Context(
        run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config=own
    )

    def query(content: RecordDict) -> int:
        msg = Message(content, dst_node_id=1, message_type=MessageType.QUERY)
        reply = client_app.app(msg, context)
        assert not reply.has_error(), reply.error
        assert run_config_of(msg, context)["seed"] == (5 if keys.RUN_CONFIG in content else 0)
        return int(reply.content[keys.SITE_INFO][keys.NUM_EXAMPLES])

    sent = ConfigRecord({"seed": 5, "alpha": 0.1})
    theirs = query(RecordDict({keys.RUN_CONFIG: sent}))
    mine = query(RecordDict({}))
    assert theirs == len(load_site(node_config, {**own, "seed": 5, "alpha": 0.1}).x_train)
    assert mine == len(load_site(node_config, own).x_train)
    assert theirs != mine  # another seed and alpha: another Dirichlet share


@pytest.mark.parametrize("given", ["4", 6, "london,ohio", ["a1", "b2"]])
def test_a_count_of_sites_names_them_as_the_server_does(given: object) -> None:
    # `flplatform run APP -c sites=4` reaches the sites as "4": partition 0 is london,
    # not a site named "4" (the ledger names sites as they name themselves).
    from clients.site import SiteDataConfig
    from flplatform.app.config import RunConfig

    site_side = SiteDataConfig.from_run_config({"sites": given}).sites
    assert site_side == RunConfig.from_mapping({"sites": given}).sites
