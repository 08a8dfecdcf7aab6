"""The accuracy research notebook: how far a release is from the truth, and why the defaults are
what they are (offline, seeded data; no broker). bench/README.md lists the modules.

``grid`` is the library of the accuracy grid (cells, draws, the regret rule) that
``accuracy_grid``, ``lofo``, ``coverage28``, ``calibration``, ``layer_cost``, ``grid_extra`` and
``select_study`` share; ``grid_defaults.json`` is the grid's choice, written by ``accuracy_grid``
and checked by tests/test_grid_defaults.py.
"""
