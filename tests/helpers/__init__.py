"""Code the tests share, and only that: no test module imports another.

* ``cli``: the CLI run in-process (never a traceback), its one ``error:`` line, its tables.
* ``sites``: scripted sites for the round engine, the digits model, a restarting site.
* ``engine``: the round engine over a SQL ledger, the bytes Flower counts per message.
* ``algorithms``: each built-in strategy with its mod; a count sketch without collisions.
* ``scripted_grid``, ``idle_sites``, ``delayed_sites``: in-process grids and their sites.
* ``fleet_oracle``: Flower's own traffic counting, and a naive rebuild of it.
* ``ledgers``: a migrated, empty SQLite ledger, made once and copied.
* ``busy_ledger``, ``comparison_ledger``, ``ledger_records``: ledgers and rows by hand.
* ``data_files``: dataset files (IDX) and rows compared as multisets.
* ``processes``: the integration tests' real processes.

The fixtures built on these are in tests/conftest.py.
"""
