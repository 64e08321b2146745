"""flplatform: communication-efficient cross-silo federated learning on Flower."""

__version__ = "0.1.0"
