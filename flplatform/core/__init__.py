"""The bottom layer: the vocabulary every other layer shares.

Errors, message keys, value checks, seeding, Flower ``Array`` encoding, ledger row
columns, state files and state reading, the deployed sites' registry file. It imports
nothing else of the platform's own (``make lint`` checks the layers).
"""
