"""The release defaults are the accuracy grid's choices, and the release really uses them.

bench/accuracy/accuracy_grid.py writes the candidate with the lowest worst-case regret per
(mode, layers) to bench/accuracy/grid_defaults.json (docs/accuracy_grid.md has the measurements);
aggregator.estimators.DEFAULTS must say the same, and a release that names no estimator and no cap
rule must be exactly the one that names the defaults.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from aggregator import largedomain as ld
from aggregator.estimate import CAP_RULES
from aggregator.estimators import (
    default_cap,
    default_method,
    DEFAULTS,
    METHODS,
    MODES,
    phi_estimate,
)
from aggregator.anonymize import anonymized_histogram
from aggregator.noise import discrete_laplace, p_from_epsilon

GRID = Path(__file__).resolve().parent.parent / "bench" / "accuracy" / "grid_defaults.json"


def test_code_defaults_are_the_grids_choice():
    chosen = json.loads(GRID.read_text())["defaults"]
    want = {
        (mode, int(k)): (v["method"], v["cap"])
        for mode, per in chosen.items()
        for k, v in per.items()
    }
    assert want == DEFAULTS


def test_the_grid_adopted_no_snr_rule():
    """bench/accuracy/accuracy_grid.py also judges rules on the public signal-to-noise ratio that
    would
    replace a DEFAULTS entry when n is known; none has won held out, and the code has none. If
    the grid adopts one, this fails: the release must then learn to apply it."""
    assert json.loads(GRID.read_text()).get("rules", {}) == {}


def test_defaults_table_is_complete_and_valid():
    for mode in MODES:
        for k in sorted({kk for m, kk in DEFAULTS if m == mode}):
            method, cap = DEFAULTS[(mode, k)]
            assert method in METHODS and cap in CAP_RULES and cap != "none"
    # more layers than the grid measured: the largest measured layer count's entry
    top = max(kk for m, kk in DEFAULTS if m == "direct")
    assert default_method("direct", top + 3) == default_method("direct", top)
    assert default_cap("hashed", top + 1) == default_cap("hashed", top)
    with pytest.raises(ValueError):
        default_method("sideways", 1)
    with pytest.raises(ValueError):
        default_cap("direct", 0)


def _direct(layers, rng):
    h = np.concatenate([rng.integers(1, 40, 150), np.zeros(2_000, np.int64)])
    p = p_from_epsilon(1.0)
    noisy = h.copy()
    for _ in range(layers):
        noisy += discrete_laplace(p, len(h), rng=rng)
    return noisy, p, int(h.sum())


def _hashed(layers, rng):
    h = np.unique(rng.zipf(1.2, 3_000), return_counts=True)[1]
    n, B, p = int(h.sum()), 6_000, p_from_epsilon(1.0)
    noisy = np.bincount(rng.integers(0, B, len(h)), weights=h, minlength=B).astype(np.int64)
    for _ in range(layers):
        noisy += discrete_laplace(p, B, rng=rng)
    return noisy, p, n, B


@pytest.mark.parametrize("layers", [1, 2, 3, 4])
def test_direct_release_uses_the_default_rule(layers):
    noisy, p, n = _direct(layers, np.random.default_rng(layers))
    named = anonymized_histogram(
        noisy,
        p,
        layers=layers,
        n=n,
        method=default_method("direct", layers),
        cap=default_cap("direct", layers),
    )
    np.testing.assert_array_equal(anonymized_histogram(noisy, p, layers=layers, n=n), named)
    np.testing.assert_array_equal(
        phi_estimate(noisy, p, layers=layers),
        phi_estimate(noisy, p, layers=layers, method=default_method("direct", layers)),
    )


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_hashed_release_uses_the_default_rule(layers):
    noisy, p, n, B = _hashed(layers, np.random.default_rng(10 + layers))
    named = anonymized_histogram(
        noisy,
        p,
        layers=layers,
        n=n,
        buckets=B,
        method=default_method("hashed", layers),
        cap=default_cap("hashed", layers),
    )
    np.testing.assert_array_equal(
        anonymized_histogram(noisy, p, layers=layers, n=n, buckets=B), named
    )
    np.testing.assert_array_equal(
        ld.hashed_phi_estimate(noisy, p, layers=layers),
        phi_estimate(
            noisy, p, layers=layers, mode="hashed", method=default_method("hashed", layers)
        ),
    )
