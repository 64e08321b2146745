"""The platform's own application over ``start()``: the options table (``RunConfig``) and
its rules, federations and sweeps of runs, the demo and its comparisons.
"""
