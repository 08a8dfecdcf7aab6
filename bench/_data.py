"""Shared synthetic-data and error helpers for the accuracy benchmarks.

Benchmarks only: the noise here is drawn from a *seeded* numpy Generator so runs are
reproducible. Seeded noise is not private; production code always uses the OS CSPRNG.

Item distributions over a domain [D] (items sampled multinomially, n events):

* ``zipf``      weights 1 / i**1.1, i = 1..D; ``zipf0.7``, ``zipf1.5``, ``zipf2``: other exponents
* ``uniform``   weights 1
* ``geometric`` weights rho**i with rho = 1 - 10 / D (mean rank about D / 10, so the support
                 that matters scales with D instead of collapsing to a handful of items)
* ``heavy``     5 heavy hitters holding half the mass (0.2, 0.12, 0.08, 0.06, 0.04), the other
                 half uniform over the remaining D - 5 items (with D >> n: a long tail of
                 singletons)

Real frequency profiles (:data:`REAL`), shipped inside PyPI packages (the ``bench`` extra): the
profile is a probability vector over its vocabulary (D = the vocabulary size, the state's
counters), and n events are drawn from it multinomially.

* ``wf-<lang>``: wordfreq 3.1 'large' lists (frequencies aggregated from Wikipedia, subtitles,
  news, books, web text, Twitter, Reddit; binned to centibels), top 1e5 words: en, de, ja, ar.
* ``sc-<lang>``: pyspellchecker 0.9 dictionaries (word counts from OpenSubtitles, words seen
  >= 50 times, all kept): es, ru, fa, lv.
* ``ss-en``, ``ss-en2``: symspellpy 6.10's English unigram (82,765 words) and bigram
  (243,342 pairs) counts (Google Books Ngram derived).
* :data:`NEW_REAL` (held out from the grid): ``jb-zh`` (jieba), ``ac-en`` (autocorrect), ``py-ids``
  (Python standard-library identifiers).
"""

from __future__ import annotations

import math

from pathlib import Path

import numpy as np

from aggregator.estimate import aligned_histograms

from aggregator.estimate import l1_distance
from aggregator.noise import discrete_laplace

DISTRIBUTIONS = ("zipf", "uniform", "geometric", "zipf0.7", "zipf1.5", "zipf2", "heavy")
REAL = ("wf-en", "wf-de", "wf-ja", "wf-ar", "sc-es", "sc-ru", "sc-fa", "sc-lv", "ss-en", "ss-en2")
REAL_TOP = 100_000  # wordfreq lists: the top words kept
# Real profiles from sources the accuracy grid never used (issue 28's held-out families): for the
# leave-one-family-out study (bench/accuracy/lofo.py), not in the grid's cells.
# * ``jb-zh``: jieba 0.42's Chinese dictionary (349,046 words with corpus counts);
# * ``ac-en``: autocorrect 2.6's English word counts (a different corpus than wordfreq / symspell);
# * ``py-ids``: identifier counts in this Python's standard library source (program identifiers,
#   tokenize NAME tokens less keywords; tests left out).
NEW_REAL = ("jb-zh", "ac-en", "py-ids")


def real_profile(name: str) -> np.ndarray:
    """Probability vector (decreasing) of a real frequency profile :data:`REAL` (cached)."""
    if name in _REAL_CACHE:
        return _REAL_CACHE[name]
    src, lang = name.split("-", 1)
    if src == "wf":
        import wordfreq

        f = np.fromiter(wordfreq.get_frequency_dict(lang, wordlist="large").values(), np.float64)
        f = np.sort(f)[::-1][:REAL_TOP]
    elif src == "sc":
        import gzip
        import json
        import os
        import spellchecker

        path = os.path.join(os.path.dirname(spellchecker.__file__), "resources", f"{lang}.json.gz")
        with gzip.open(path) as fh:
            f = np.sort(np.fromiter(json.load(fh).values(), np.float64))[::-1]
    elif src == "ss":
        import os
        import symspellpy

        base = os.path.dirname(symspellpy.__file__)
        fn = (
            "frequency_bigramdictionary_en_243_342.txt"
            if lang == "en2"
            else "frequency_dictionary_en_82_765.txt"
        )
        with open(os.path.join(base, fn), encoding="utf-8") as fh:
            f = np.sort(np.array([float(line.split()[-1]) for line in fh if line.strip()]))[::-1]
    elif src == "jb":  # jieba's dictionary: word, count, part of speech per line
        import os
        import jieba

        with open(
            os.path.join(os.path.dirname(jieba.__file__), "dict.txt"), encoding="utf-8"
        ) as fh:
            f = np.sort(np.array([float(line.split()[1]) for line in fh if line.strip()]))[::-1]
    elif src == "ac":  # autocorrect's English word counts (word_count.json in en.tar.gz)
        import json
        import os
        import tarfile
        import autocorrect

        with tarfile.open(
            os.path.join(os.path.dirname(autocorrect.__file__), "data", "en.tar.gz")
        ) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("word_count.json"))
            counts = json.load(tar.extractfile(member))
        f = np.sort(np.fromiter(counts.values(), np.float64))[::-1]
    elif src == "py":  # identifiers in the Python standard library's source (keywords left out)
        import collections
        import keyword
        import sysconfig
        import tokenize

        c = collections.Counter()
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            if {"site-packages", "test", "tests"} & set(path.parts):
                continue
            try:
                with open(path, "rb") as fh:
                    c.update(
                        t.string
                        for t in tokenize.tokenize(fh.readline)
                        if t.type == tokenize.NAME and not keyword.iskeyword(t.string)
                    )
            except (SyntaxError, tokenize.TokenError, UnicodeDecodeError):
                continue  # (a few files are deliberately broken or in other encodings)
        f = np.sort(np.fromiter(c.values(), np.float64))[::-1]
    else:
        raise ValueError(f"unknown real profile {name!r}")
    w = f / f.sum()
    _REAL_CACHE[name] = w
    return w


_REAL_CACHE: dict = {}


def weights(dist: str, D: int) -> np.ndarray:
    if dist in REAL or dist in NEW_REAL:
        w = real_profile(dist)
        if len(w) != D:
            raise ValueError(f"{dist} has {len(w)} items, not D = {D}")
        return w
    i = np.arange(1, D + 1, dtype=np.float64)
    if dist == "zipf":
        w = i**-1.1
    elif dist.startswith("zipf"):
        w = i ** -float(dist[4:])
    elif dist == "heavy":
        heavy = np.array([0.2, 0.12, 0.08, 0.06, 0.04])
        w = np.full(D, 0.5 / max(D - 5, 1))
        w[:5] = heavy
    elif dist == "uniform":
        w = np.ones(D)
    elif dist == "geometric":
        rho = 1.0 - 10.0 / D if D > 20 else 0.5
        w = np.exp((i - 1) * math.log(rho))
    else:
        raise ValueError(dist)
    return w / w.sum()


def true_counts(rng: np.random.Generator, dist: str, D: int, n: int) -> np.ndarray:
    """h_j for j in [D]: n events drawn i.i.d. from the item distribution."""
    return rng.multinomial(n, weights(dist, D)).astype(np.int64)


def noisy(rng: np.random.Generator, h: np.ndarray, p: float, layers: int) -> np.ndarray:
    """h + sum of ``layers`` independent DLap(p) layers (seeded; benchmark only)."""
    out = h.copy()
    for _ in range(layers):
        out += discrete_laplace(p, len(h), rng=rng)
    return out


def naive(noisy_counts: np.ndarray) -> np.ndarray:
    """Baseline: sort the noisy counts, drop values <= 0."""
    x = np.sort(noisy_counts)[::-1]
    return x[x > 0]


def l2sq_distance(a, b) -> int:
    """Squared l2 between anonymized histograms (sorted decreasing, zero-padded)."""
    a, b = aligned_histograms(a, b)
    return int(((a - b) ** 2).sum())


def errors(h, est) -> tuple[float, float]:
    return float(l1_distance(h, est)), l2sq_distance(h, est)


def c_p(p: float) -> float:
    return p * p / (1 - p) ** 5 + p / (1 - p)


def theorem9_shape(p: float, n: int, D: int) -> float:
    """sqrt(C_p (n + D) log n): the *shape* of Theorem 9's bound (constant 1, not exact)."""
    return math.sqrt(c_p(p) * (n + D) * math.log(max(n, 2)))
