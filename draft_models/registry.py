"""The draft kinds: a plain dict kind -> builder, and the spec strings that name them.

    from draft_models.registry import build_draft, draft_slug
    draft = build_draft("layerskip:8", target, tokenizer, run_dir, device)   # -> engine Draft
    draft_slug("self:w4a16-gptq")                                             # "self-w4a16-gptq"

Spec strings: `ngram` (or `ngram:<max_n>`), `layerskip:<n>`, `self:<variant>`, `hf:<id or path>`,
`eagle3:<dir>` (an EAGLE-3 head: vLLM runs it, specq's engine does not: SERVED_ONLY, engine_specs).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from draft_models import eagle3, hf, layerskip, ngram, selfdraft
from pipeline.core.stage import StageError

# kind -> build(spec, target, tokenizer, run_dir, device) -> a runtime draft (pipeline.decode.drafts)
BUILDERS: dict[str, Callable] = {"ngram": ngram.build, "layerskip": layerskip.build, "self": selfdraft.build,
                                 "hf": hf.build, "eagle3": eagle3.build}
# Kinds only the serving engine runs, and why.
SERVED_ONLY: dict[str, str] = {"eagle3": eagle3.SERVED_ONLY}


def parse_spec(spec: str) -> tuple[str, str]:
    kind, _, arg = spec.partition(":")
    if kind not in BUILDERS:
        raise StageError(f"unknown draft '{spec}' (kinds: {', '.join(BUILDERS)}; e.g. ngram, layerskip:8, "
                         "self:w4a16-gptq, hf:<id or path>, eagle3:<dir>)")
    return kind, arg


def draft_slug(spec: str) -> str:
    """File-safe name for a draft spec: 'layerskip:8' -> 'layerskip-8', 'hf:org/m' -> 'hf-org-m'."""
    parse_spec(spec)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", spec.replace(":", "-")).strip("-.")


def build_draft(spec: str, target, tokenizer, run_dir: str | Path | None, device):
    """Build the draft for `spec` against `target` (the model it will draft for)."""
    kind, _ = parse_spec(spec)
    return BUILDERS[kind](spec, target, tokenizer, Path(run_dir) if run_dir is not None else None, device)


def engine_specs(specs: list[str], stage: str, progress=None) -> list[str]:
    """The draft specs specq's engine runs; each other one is said once on `progress`."""
    out = []
    for spec in specs:
        kind, _ = parse_spec(spec)
        if kind in SERVED_ONLY:
            if progress:
                progress(f"{stage}: {spec}: {SERVED_ONLY[kind]}; not measured by specq's engine")
            continue
        out.append(spec)
    return out
