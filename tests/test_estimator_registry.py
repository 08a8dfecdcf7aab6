"""The estimators' registry (aggregator.estimators.ESTIMATORS) is the one place an estimator's
name is written: the config's choices, hashed mode's list, ``auto``'s candidates and
``panagg estimators`` read it, and phi_estimate dispatches through it."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from aggregator import estimator as base
from aggregator import largedomain, selection
from aggregator.estimators import ESTIMATORS, METHODS, estimator, phi_estimate


def test_every_name_is_the_key_of_its_estimator():
    assert METHODS == tuple(ESTIMATORS)
    assert all(e.name == name for name, e in ESTIMATORS.items())
    assert METHODS == ("threshold", "deconvolution", "mle", "wupagh", "xfit", "auto")


def test_the_config_hashed_mode_and_auto_read_the_registry():
    from aggregator.service.settings import SETTINGS

    assert SETTINGS["release.estimator"].choices == ("default", *METHODS)
    assert largedomain.HASHED_METHODS == tuple(n for n, e in ESTIMATORS.items() if e.hashed)
    # auto chooses among the estimators that need only the counters (none of them uses n)
    assert {m for m, _ in selection.CANDIDATES} == set(base.BASIC_METHODS)
    assert set(selection.PILOTS) <= set(base.BASIC_METHODS)
    assert not any(ESTIMATORS[m].uses_n for m in base.BASIC_METHODS)


def test_panagg_estimators_lists_the_registry(capsys):
    from aggregator.service.cli import cmd_estimators

    assert cmd_estimators(argparse.Namespace()) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == ["default", *METHODS]


def test_phi_estimate_dispatches_through_the_registry():
    x = np.array([3, 0, 1, 0, 0, 2, 0, 0])
    for name in ("threshold", "deconvolution", "mle"):
        assert np.array_equal(phi_estimate(x, 0.3, method=name), estimator(name).estimate(x, 0.3))
    with pytest.raises(ValueError, match="method must be one of"):
        phi_estimate(x, 0.3, method="nope")
    with pytest.raises(ValueError, match="the wupagh estimator cannot run on 48 noise layers"):
        phi_estimate(x, 0.6065, layers=48, method="wupagh")
