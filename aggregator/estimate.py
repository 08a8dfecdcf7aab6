"""The estimator core's old single module, kept as a list of where each part now lives.

From noisy counters to an anonymized histogram (seed 001 Algorithms 1, 3, 5; Appendix E) used to
be this one module; it is now one module per concept, each importing only those below it
(tests/test_layering.py):

* :mod:`aggregator.counters`: the value counts c_v, the noise pmf, the checks;
* :mod:`aggregator.histograms`: anonymized histograms <-> cumulative prevalences, l1 distances;
* :mod:`aggregator.threshold`: the unbiased inverse-filter estimate (``"threshold"``);
* :mod:`aggregator.convolution`: convolution with one fixed kernel (the EM's inner loop);
* :mod:`aggregator.em`: the EM for the prevalences (NPMLE), its axis and SQUAREM;
* :mod:`aggregator.deconvolution`: the EM stopped early (``"deconvolution"``) or converged
  (``"mle"``), one counter set or a batch;
* :mod:`aggregator.crossfit`: the EM stopped by held-out likelihood (``"xfit"``);
* :mod:`aggregator.projection`: the l1 and l2 projections onto valid histograms;
* :mod:`aggregator.cap`: the cap at the public n;
* :mod:`aggregator.memo`: what a release keeps of its counters for its error bars;
* :mod:`aggregator.estimator`, :mod:`aggregator.estimators`: estimators as objects, by name.

Code outside the package (tests, bench, docs, users) may keep importing these names from here;
no module of the package does (tests/test_layering.py checks it), so this module is no layer.

>>> from aggregator import estimate, projection
>>> estimate.project_l1 is projection.project_l1
True
"""

from __future__ import annotations

from .cap import CAP_RULES, cap_total
from .convolution import convolve as _conv
from .counters import (
    NoisyValueCounts,
    check_layers as _check_layers,
    check_p as _check_p,
    counters_key,
    data_seed as _data_seed,
    noise_pmf,
    noisy_value_counts,
)
from .crossfit import (
    XFIT_BIN,
    XFIT_MAX_ITER,
    XFIT_PATIENCE,
    XFIT_TOL,
    crossfit_prevalence,
)
from .deconvolution import (
    DECONV_MAX_ITER,
    DECONV_TOL,
    MLE_MAX_ITER,
    MLE_TOL,
    chi2_shift,
    deconv_tol,
    deconvolved_batch,
    deconvolved_prevalence,
    em_prevalences,
    em_prevalences_many,
)
from .em import (
    DIRECT_START_SMOOTH_SHARE,
    EM_TAIL,
    SPARSE_DENSITY,
    START_SMOOTH_SHARE,
    EMProblem as _EMProblem,
    _sparse_counters,
    em_problem as _em_problem,
    mean_m_step as _mean_m_step,
    pass_through_bound,
    sparse_top,
    squarem as _squarem,
)
from .estimator import BASIC_METHODS, basic_prevalence
from .histograms import (
    aligned_histograms,
    checked_cumulative,
    counts_from_cumulative,
    cumulative_from_counts,
    cumulative_l1,
    l1_distance,
    prevalences_from_cumulative,
)
from .memo import ReleaseMemo, remembered_fit as _remembered_fit
from .projection import project_l1, project_l2, rank_box
from .threshold import (
    THRESHOLD_GRID_LAYERS,
    THRESHOLD_MAX_GAIN,
    cumulative_prevalence,
    threshold_kernel,
    threshold_usable,
)

__all__ = [
    "NoisyValueCounts",
    "noisy_value_counts",
    "threshold_kernel",
    "cumulative_prevalence",
    "deconvolved_prevalence",
    "crossfit_prevalence",
    "project_l1",
    "cap_total",
    "CAP_RULES",
    "project_l2",
    "counts_from_cumulative",
    "cumulative_from_counts",
    "prevalences_from_cumulative",
    "cumulative_l1",
    "l1_distance",
    "MLE_MAX_ITER",
    "BASIC_METHODS",
    "basic_prevalence",
    "checked_cumulative",
    "MLE_TOL",
    "DECONV_MAX_ITER",
    "DECONV_TOL",
    "deconv_tol",
    "chi2_shift",
    "em_prevalences",
    "em_prevalences_many",
    "deconvolved_batch",
    "pass_through_bound",
    "sparse_top",
    "SPARSE_DENSITY",
    "rank_box",
    "aligned_histograms",
    "noise_pmf",
    # also here for the code that imported them from this module
    "THRESHOLD_GRID_LAYERS",
    "THRESHOLD_MAX_GAIN",
    "threshold_usable",
    "XFIT_BIN",
    "XFIT_MAX_ITER",
    "XFIT_PATIENCE",
    "XFIT_TOL",
    "START_SMOOTH_SHARE",
    "DIRECT_START_SMOOTH_SHARE",
    "EM_TAIL",
    "ReleaseMemo",
    "counters_key",
    # private names that tests and bench reach for
    "_EMProblem",
    "_check_layers",
    "_check_p",
    "_conv",
    "_data_seed",
    "_em_problem",
    "_mean_m_step",
    "_remembered_fit",
    "_sparse_counters",
    "_squarem",
]
