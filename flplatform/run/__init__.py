"""One run on the round engine: ``start()`` (what ``flplatform.start`` calls), its options,
the ledger row it keeps, its log lines, and the adapter that runs Flower's own strategies.
"""
