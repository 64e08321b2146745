"""own-app: a Flower app with its own model, data and training loop."""
