"""Calibration text for the schemes that need it (GPTQ): windows of token ids, and the text's hash.

    from pipeline.variants.calibration import load_calibration
    cal = load_calibration(cfg.quantize.calibration, tokenizer)   # cal.windows, cal.sha256, cal.tokens

`quantize.calibration.source: builtin` is evals/data/calibration.txt, which ships with the project;
anything else is a path. Calibration data and test data stay separate: no eval slice is built from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.core.stage import REPO, StageError, progress, sha256_file

BUILTIN_CALIBRATION = REPO / "evals" / "data" / "calibration.txt"


@dataclass
class Calibration:
    path: Path
    sha256: str
    windows: list[list[int]]  # token ids, one list per calibration sample
    tokens_available: int

    @property
    def tokens(self) -> int:
        return sum(len(w) for w in self.windows)


def calibration_path(source: str) -> Path:
    return BUILTIN_CALIBRATION if source == "builtin" else Path(source).expanduser()


def load_calibration(ccfg, tokenizer) -> Calibration:
    """n_samples windows of max_tokens tokens, evenly spread over the calibration text (so every
    language and the code in it are represented); refuse a text shorter than min_tokens."""
    path = calibration_path(ccfg.source)
    if not path.is_file():
        raise StageError(f"calibration text missing: {path} (quantize.calibration.source is '{ccfg.source}')")
    text = path.read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < ccfg.min_tokens:
        raise StageError(f"calibration text {path} is too short: {len(ids)} tokens, fewer than "
                         f"quantize.calibration.min_tokens = {ccfg.min_tokens}")
    size = min(ccfg.max_tokens, len(ids))
    n = max(1, min(ccfg.n_samples, len(ids) // size))
    if n < ccfg.n_samples or size < ccfg.max_tokens:
        # Windows do not overlap, so a short text gives fewer of them than asked; say so once
        # rather than repeat text (meta.json records asked and used).
        progress(f"quantize: calibration text {path.name} has {len(ids)} tokens: {n} windows of {size} "
                 f"tokens, fewer than the {ccfg.n_samples} x {ccfg.max_tokens} asked (quantize.calibration)")
    starts = [round(i * (len(ids) - size) / max(1, n - 1)) for i in range(n)]
    return Calibration(path, sha256_file(path), [ids[s:s + size] for s in starts], len(ids))
