"""The names of what a site can build and read: models, datasets, partition schemes.

Said once, here, for the sites (``clients.models``, ``clients.datasets``,
``clients.partitioning``) and the run configuration's options alike. Pure: listing them
imports neither torch nor numpy.
"""

from __future__ import annotations

MODELS: tuple[str, ...] = ("mlp", "cnn", "wide-mlp", "resnet")
BUILTIN_DATASETS: tuple[str, ...] = ("digits", "mnist5k", "fashion-mnist", "synthetic")
PARTITION_SCHEMES: tuple[str, ...] = ("iid", "dirichlet")
# The run configuration's partitions: a scheme, or "files" (one file per site, written by
# `flplatform data split`).
PARTITIONS: tuple[str, ...] = (*PARTITION_SCHEMES, "files")
