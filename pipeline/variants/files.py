"""Files of a variant directory: what specq adds, hard-linked weights, weight bytes on disk."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from pipeline.models.loading import WEIGHT_SUFFIXES, weight_files

# Files of a prepared model or variant that belong to specq, not to the HF checkpoint.
SPECQ_FILES = frozenset({"meta.json", "model_info.json"})


def link_or_copy_tree(src: Path, out: Path, skip: frozenset[str] = SPECQ_FILES) -> None:
    """Hard-link every weight file of `src` into `out` (copy across file systems) and copy the rest.
    Weight files are never written in place by anyone, so sharing their inodes is safe and costs
    no disk; tokenizer and config files are rewritten in the variant (save_pretrained opens them
    for writing in place), which through a hard link would edit the source directory."""
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if p.is_dir() or rel.name in skip:
            continue
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not p.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(p, dst)
            continue
        try:
            os.link(p, dst)
        except OSError:
            shutil.copy2(p, dst)


def weight_bytes(path: Path) -> int:
    """Bytes of the weight files in a model directory (config/tokenizer files excluded)."""
    return sum(p.stat().st_size for p in weight_files(path))
