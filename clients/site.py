"""A site: its own data, its model, its device.

In simulation a site's data is its partition (``partition-id`` of ``num-partitions`` in
the node config) of a dataset named in the run config; in deployment the node config's
``data-path`` names the site's own file, and nothing else is read. With the run config's
``standardize-features`` the site standardises its features with its own training split's
statistics (``clients.scaling``), which never leave it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from clients.datasets import load_dataset, load_site_file
from clients.models import build_model
from clients.partitioning import partition_indices
from clients.scaling import feature_scale, standardize
from clients.site_files import read_manifest
from clients.training import pick_device
from flplatform.core import keys
from flplatform.core.checks import DEFAULT_SITES, as_bool, as_site_names
from flplatform.core.errors import ConfigError
from flplatform.core.seeding import rng_for

if TYPE_CHECKING:
    from flwr.app import Context, Message

# A tenth of each site's data stays local for federated evaluation.
LOCAL_VALIDATION_FRACTION = 0.1


@dataclass(frozen=True)
class LocalSite:
    """Everything a ClientApp knows about the site it runs on."""

    name: str
    partition_id: int | None
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    model_name: str
    device: torch.device

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example, (C, H, W)."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def feature_scale(self) -> float:
        """How far its training features are from unit scale (``clients.scaling``)."""
        return feature_scale(self.x_train)

    def build_model(self, num_classes: int, seed: int = 0) -> nn.Module:
        """A fresh model of the run's architecture for this site's inputs."""
        return build_model(
            self.model_name, input_shape=self.input_shape, num_classes=num_classes, seed=seed
        )


@dataclass(frozen=True)
class SiteDataConfig:
    """The run-config keys a site reads: which data, split how, and which model.

    Parsed here rather than by the server's ``RunConfig``, so loading a site imports no
    server code; the server validated the same keys before the run started.
    """

    dataset: str = "digits"
    partition: str = "dirichlet"
    alpha: float = 0.5
    model: str = "mlp"
    seed: int = 0
    sites: tuple[str, ...] = DEFAULT_SITES
    standardize_features: bool = False

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> SiteDataConfig:
        """Read the keys from a Flower run config (other keys, the app's own, are ignored)."""
        defaults = cls()
        values: dict[str, Any] = {}
        for name in ("dataset", "partition", "model"):
            values[name] = str(run_config.get(name, getattr(defaults, name))).strip()
        try:
            values["alpha"] = float(run_config.get("alpha", defaults.alpha))
            values["seed"] = int(run_config.get("seed", defaults.seed))
        except (TypeError, ValueError):
            raise ConfigError("run config 'alpha' and 'seed' must be numbers") from None
        # a count names the default sites, as the server names them (``sites = 4``)
        values["sites"] = as_site_names(
            "run config 'sites'", run_config.get("sites", defaults.sites)
        )
        values["standardize_features"] = _flag(
            run_config, "standardize-features", defaults.standardize_features
        )
        return cls(**values)


def run_config_of(msg: Message, context: Context) -> dict[str, Any]:
    """The run config this message's work belongs to: the node's, under the message's own.

    The runs of a sweep share one Flower run and its run config; a run's messages carry
    the data, model and app keys it reads differently (``keys.RUN_CONFIG``).
    """
    sent = msg.content.config_records.get(keys.RUN_CONFIG)
    return {**context.run_config, **(sent or {})}


def load_site(node_config: Mapping[str, Any], run_config: Mapping[str, Any]) -> LocalSite:
    """Load (once per process) the site described by a node config and run config."""
    config = SiteDataConfig.from_run_config(run_config)
    data_path = node_config.get(keys.DATA_PATH)
    partition = node_config.get(keys.PARTITION_ID)
    num_partitions = node_config.get(keys.NUM_PARTITIONS)
    name = node_config.get(keys.SITE_NAME)
    return _load_site(
        data_path=str(data_path) if data_path else None,
        partition_id=int(partition) if partition is not None else None,
        num_partitions=int(num_partitions) if num_partitions is not None else None,
        name=str(name) if name else None,
        config=config,
    )


@lru_cache(maxsize=8)
def _load_site(
    *,
    data_path: str | None,
    partition_id: int | None,
    num_partitions: int | None,
    name: str | None,
    config: SiteDataConfig,
) -> LocalSite:
    if data_path:
        x, y = load_site_file(data_path)
        site_name = name or _name_for(partition_id, config)
    elif config.partition == "files":
        # One file per site, in a split directory: a site reads only its own file.
        manifest = read_manifest(config.dataset)
        site_name = name or _name_for(partition_id, config)
        names = [s.name for s in manifest.sites]
        if site_name not in names:
            raise ConfigError(
                f"site '{site_name}' has no file in {manifest.manifest_path.parent}; "
                f"the split holds: {', '.join(names)}"
            )
        x, y = load_site_file(manifest.site(site_name).path)
    else:
        if partition_id is None or num_partitions is None:
            raise ConfigError(
                "this node has neither 'data-path' nor 'partition-id'/'num-partitions' in its "
                'node config; start the SuperNode with --node-config "data-path=site.npz"'
            )
        if not 0 <= partition_id < num_partitions:
            raise ConfigError(f"partition-id {partition_id} is not in [0, {num_partitions})")
        dataset = load_dataset(config.dataset, seed=config.seed)
        parts = partition_indices(
            dataset.y_train,
            num_partitions,
            scheme=config.partition,
            alpha=config.alpha,
            seed=config.seed,
        )
        idx = parts[partition_id]
        x, y = dataset.x_train[idx], dataset.y_train[idx]
        site_name = name or _name_for(partition_id, config)
    # ---- keep a seeded local validation slice for federated evaluation
    order = rng_for(config.seed, "validation", site_name).permutation(len(x))
    n_val = int(len(x) * LOCAL_VALIDATION_FRACTION) if len(x) >= 10 else 0
    val, train = order[:n_val], order[n_val:]
    x_train, x_val = x[train], x[val]
    if config.standardize_features:
        # The training split's statistics only: the validation slice is held-out data.
        x_train, x_val = standardize(x_train, x_val)
    return LocalSite(
        name=site_name,
        partition_id=partition_id,
        x_train=x_train,
        y_train=y[train],
        x_val=x_val,
        y_val=y[val],
        model_name=config.model,
        device=pick_device(),
    )


def _flag(run_config: Mapping[str, Any], key: str, default: bool) -> bool:
    """A yes/no run-config key, spelt as ``RunConfig`` accepts it (Flower passes a bool)."""
    return as_bool(run_config.get(key, default), f"run config '{key}'")


def _name_for(partition_id: int | None, config: SiteDataConfig) -> str:
    if partition_id is not None and partition_id < len(config.sites):
        return config.sites[partition_id]
    return f"site-{partition_id}"


@dataclass(frozen=True)
class TestSet:
    """What the server evaluates on, and the shapes its model is built for."""

    x: np.ndarray
    y: np.ndarray
    input_shape: tuple[int, ...]
    num_classes: int


def load_test_set(*, dataset: str, partition: str, seed: int) -> TestSet:
    """The held-out test set of a run's data (the split's test.npz for ``files``)."""
    if partition == "files":
        manifest = read_manifest(dataset)
        x, y = load_site_file(manifest.test.path)
        return TestSet(x, y, tuple(manifest.input_shape), manifest.num_classes)
    data = load_dataset(dataset, seed=seed)
    return TestSet(data.x_test, data.y_test, data.input_shape, data.num_classes)
