"""Calibration metrics of multiple-choice items (option probabilities and the right option), for
the quality summaries and the gate: the per-item multi-class Brier score the gate tests (in
[0, 2], lower is better), the plug-in ECE over 10 equal-width bins (reported, never gated), and
the debiased l2 calibration error over equal-mass bins (Kumar, Liang & Ma 2019).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

ECE_BINS = 10


def normalised(probs) -> np.ndarray:
    p = np.asarray(probs, dtype=float)
    if p.ndim != 1 or p.size < 2 or not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() <= 0:
        raise ValueError(f"option_probs must be >= 2 finite non-negative numbers, got {list(p)}")
    return p / p.sum()


def brier_per_item(option_probs: Sequence[Sequence[float]], labels: Sequence[int]) -> np.ndarray:
    """Multi-class Brier score per item, after normalising each item's probabilities to sum to 1.
    A 2-D array (every item with the same options) is scored in one vectorised pass."""
    if isinstance(option_probs, np.ndarray) and option_probs.ndim == 2:
        p, y = option_probs.astype(float), np.asarray(labels, dtype=int)
        if not np.all(np.isfinite(p)) or np.any(p < 0) or np.any(p.sum(axis=1) <= 0) or p.shape[1] < 2:
            raise ValueError("option_probs must be rows of >= 2 finite non-negative numbers")
        if np.any((y < 0) | (y >= p.shape[1])):
            raise ValueError(f"labels must lie in 0..{p.shape[1] - 1}")
        p = p / p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        return (p**2).sum(axis=1)
    out = np.empty(len(labels))
    for i, (probs, label) in enumerate(zip(option_probs, labels)):
        p = normalised(probs)
        if not 0 <= int(label) < p.size:
            raise ValueError(f"label {label} is not one of {p.size} options")
        p[int(label)] -= 1.0
        out[i] = float((p**2).sum())
    return out


def confidence_and_correct(option_probs, labels) -> tuple[np.ndarray, np.ndarray]:
    """Top option's probability and whether the top option is the label (ties: the first)."""
    conf, correct = np.empty(len(labels)), np.empty(len(labels))
    for i, (probs, label) in enumerate(zip(option_probs, labels)):
        p = normalised(probs)
        conf[i], correct[i] = p.max(), float(int(p.argmax()) == int(label))
    return conf, correct


def _bins(confidence: np.ndarray, bins: int, scheme: str) -> list[np.ndarray]:
    """Item indices per non-empty bin. "width": [k/B, (k+1)/B), the last bin closed at 1;
    "mass": the items sorted by confidence, cut into B groups of (nearly) equal size."""
    if scheme == "width":
        which = np.minimum((confidence * bins).astype(int), bins - 1)
        return [np.flatnonzero(which == b) for b in range(bins) if np.any(which == b)]
    if scheme == "mass":
        return [chunk for chunk in np.array_split(np.argsort(confidence, kind="stable"), bins) if chunk.size]
    raise ValueError(f"unknown binning {scheme!r} (width, mass)")


def calibration_error(confidence, correct, bins: int = ECE_BINS, scheme: str = "width",
                      power: int = 1, debias: bool = False) -> float:
    """Binned calibration error (sum_b n_b/n |conf_b - acc_b|^power)^(1/power); with debias
    (power 2 only) each bin's term loses acc_b (1 - acc_b) / (n_b - 1), its expected excess
    under sampling noise, and bins of one item count 0 (Kumar et al. 2019)."""
    confidence = np.asarray(confidence, dtype=float)
    correct = np.asarray(correct, dtype=float)
    if confidence.size == 0:
        return math.nan
    if debias and power != 2:
        raise ValueError("the debiased estimator is for the l2 calibration error (power=2)")
    total = 0.0
    for idx in _bins(confidence, bins, scheme):
        acc, conf = correct[idx].mean(), confidence[idx].mean()
        term = abs(conf - acc) ** power
        if debias:
            term = term - acc * (1.0 - acc) / (idx.size - 1) if idx.size > 1 else 0.0
        total += idx.size / confidence.size * term
    return float(max(total, 0.0) ** (1.0 / power))


def calibration_summary(option_probs, labels) -> dict:
    """What quality/<variant>.json and the gate report for one model on one slice."""
    conf, correct = confidence_and_correct(option_probs, labels)
    n = len(labels)
    return {"brier": float(brier_per_item(option_probs, labels).mean()) if n else math.nan,
            "ece": calibration_error(conf, correct),
            "ece_debiased": calibration_error(conf, correct, bins=max(1, min(ECE_BINS, n // 2)),
                                              scheme="mass", power=2, debias=True)}
