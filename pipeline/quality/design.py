"""The looks' design: each slice's alpha spending for a run, fitted to the quality stage's time
budget before any variant is scored (docs/methods/gate.md: "Looks fitted to the budget"), and kept in
quality/design.json for the runs that continue it.

    from pipeline.quality.design import fit_design
    waves.first_look(reference, ref_score)                # the reference's pace is measured
    design = fit_design(out_dir, waves, reference, variants, pending, budget, config.gate)
    # waves.plans[slice]["spending"] is set; the gate replays the looks with it
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.budget import fmt_s
from pipeline.core.stage import StageError, atomic_write_json, hash_obj, progress, read_json
from pipeline.quality.sequential import Waves
from pipeline.stats.sequential import fitted


DESIGN_FILE = "design.json"


def pace_priors(metas: dict[str, dict], reference: str) -> dict[str, float]:
    """variant -> its forward's seconds over the reference's, both timed by the quantize stage on
    the same 512 held-out tokens (variants/<v>/meta.json: `forward_seconds`), for every variant
    that has one: its seconds per item against the reference's before it has scored one. A
    prefill's ratio, where the first looks also decode: in the cold default run on a 2-core AVX-512
    Xeon, every variant in bf16 (docs/results/2026-12-03-run-costs.md), the priors were w4a16-gptq
    2.0, int8 6.0, w8a16 2.1, nf4 4.6 against first looks at 1.0, 2.9, 1.6 and 2.2x the reference's
    seconds: about 2x high (a forward timed in a fresh process, a prefill only); a cautious fit
    loses power, never an error rate."""
    ref = ((metas.get(reference) or {}).get("forward_seconds") or {}).get("seconds")
    if not ref:
        return {}
    out = {}
    for name, meta in metas.items():
        got = ((meta or {}).get("forward_seconds") or {}).get("seconds")
        if name != reference and got:
            out[name] = float(got) / float(ref)
    return out


def fit_design(out_dir: Path, waves: Waves, reference: str, variants: list[str], pending: list[str], budget,
               gcfg) -> dict:
    """Each slice's alpha spending for this run's looks (docs/methods/gate.md: "Looks fitted to the budget"),
    set as waves.plans[slice]["spending"] and kept in quality/design.json.

    With an active time budget that is predicted not to afford every look of every pending
    variant, each slice's spending is fitted (pipeline/stats/sequential.py: fitted) so that
    gate.budget_alpha_share of each side's alpha is spent by the last look the budget affords:
    the largest look index j whose looks, for the reference and every pending variant, cost at
    most the stage's time left, at the reference's measured seconds per item (times the variant's
    prior, pace_priors, for a variant). A budget that affords only the first looks then tests them
    at that share of alpha, where O'Brien-Fleming spending alone would test them at almost none.
    Otherwise the base spending (gate.spending).

    The design is decided from timings only, after the reference's first look and before any
    variant item is scored, so it does not depend on any variant-vs-reference difference, and
    it is kept: while any variant holds items, a re-run reads design.json (same planned looks)
    and keeps its spending whatever the new budget, so a larger budget continues the same
    spending function over the later looks and each side's error over all looks stays at its
    alpha. Variants holding items with no design.json for these looks keep the base spending."""
    path = out_dir / DESIGN_FILE
    base, share = gcfg.spending, gcfg.budget_alpha_share
    plans = waves.plans
    key = hash_obj({"looks": {s: [list(p["looks"]), int(p["n_max"])] for s, p in sorted(plans.items())},
                    "base": base})
    held = [v for v in variants if sum(waves.scored(v).values())]
    old = None
    if path.is_file():
        try:
            old = read_json(path, "quality design")
        except StageError:
            old = None
    if held and isinstance(old, dict) and old.get("key") == key and set(old.get("spending") or {}) == set(plans):
        design = {**old, "kept": True}
        progress(f"quality: the looks' spending kept from {path.name} (fitted: {old.get('fitted')}): "
                 f"{', '.join(held)} hold items scored under it")
    else:
        design = _fit(waves, reference, pending, budget, base, share, held)
        design.update(key=key, kept=False)
        atomic_write_json(path, {k: v for k, v in design.items() if k != "kept"})
        progress(f"quality: looks' spending: {design['why']}")
    for s, name in design["spending"].items():
        plans[s]["spending"] = name
    return design


def _fit(waves: Waves, reference: str, pending: list[str], budget, base: str, share: float | None,
         held: list[str]) -> dict:
    """fit_design's decision (the design record without its key)."""
    plans = waves.plans
    rec = {"base": base, "share": share, "fitted": False, "look_index": None, "predicted_s": None,
           "left_s": None, "spending": {s: base for s in plans}}
    if not budget.active:
        return {**rec, "why": f"no time budget: {base} spending"}
    if share is None:
        return {**rec, "why": f"gate.budget_alpha_share is null: {base} spending"}
    if held:
        return {**rec, "why": f"{', '.join(held)} hold items scored before any fitted design: {base} spending"}
    if not pending:
        return {**rec, "why": f"no variant to score: {base} spending"}
    looks_max = max(len(p["looks"]) for p in plans.values())

    def need(j: int) -> dict[str, int]:
        return {s: p["looks"][min(j, len(p["looks"]) - 1)] for s, p in plans.items()}

    have_ref = waves.scored(reference)

    def cost(j: int) -> float | None:  # no variant holds items here (held is empty): each scores all of it
        want = need(j)
        ref = waves.model_cost(reference, {s: max(n - have_ref[s], 0) for s, n in want.items()}, reference)
        var = [waves.model_cost(v, want, reference) for v in pending]
        if ref is None or None in var:
            return None
        return ref + sum(var)

    left, fit, fit_s = budget.left(), None, None
    for j in range(looks_max):
        c = cost(j)
        if c is None:
            return {**rec, "why": f"no seconds per item measured yet: {base} spending"}
        if c > left and j > 0:
            break
        fit, fit_s = j, c
        if c > left:
            break  # not even the first looks fit: they are scored anyway (the gate needs one)
    rec.update(left_s=round(left, 1), predicted_s=round(fit_s, 1), look_index=fit)
    if fit == looks_max - 1 and fit_s <= left:
        return {**rec, "why": f"the budget affords every look (~{fmt_s(fit_s)} of {fmt_s(left)} left): {base} spending"}
    spending = {}
    for s, p in plans.items():
        n = need(fit)[s]
        spending[s] = base if n >= p["n_max"] else fitted(base, n / p["n_max"], share)
    return {**rec, "fitted": True, "spending": spending,
            "why": (f"the budget ({fmt_s(left)} left) is predicted to afford "
                    f"{'look 1' if fit == 0 else f'looks 1-{fit + 1}'} of {looks_max} for the "
                    f"{len(pending)} variant(s) (~{fmt_s(fit_s)}): each side spends {share:.0%} of its alpha "
                    f"({base} shape) by then and the rest over the later looks")}
