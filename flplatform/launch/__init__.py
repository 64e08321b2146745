"""Starting Flower for a run: local simulations, the processes they take, and a user's own
Flower app directory (``flplatform run APP_DIR``).
"""
