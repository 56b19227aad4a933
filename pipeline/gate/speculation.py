"""The gate's speculation verdicts: per (variant, draft) pair, lossless or not, judged apart from
quality (a failing pair is no-go for speculation; it does not change a variant's decision).

    from pipeline.gate.speculation import speculation
    verdicts = speculation(run_dir, "holm")        # gate.json's `speculation`

Greedy: `greedy_lossless` from acceptance/<pair>.json; sampling: the chi-square p-values, adjusted
over the pairs with the quality cells' multiplicity method.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.stage import StageError, read_json
from pipeline.stats import paired as stats


def speculation(run_dir: Path, method: str) -> dict:
    """Per pair: the greedy verdict and the sampling test (p adjusted over the pairs)."""
    pairs = {}
    for path in sorted((run_dir / "acceptance").glob("*__*.json")):
        doc = read_json(path, "acceptance result")
        if not isinstance(doc, dict):
            raise StageError(f"corrupt artifact: {path} is not a JSON object")
        pairs[path.stem] = {"variant": doc.get("variant"), "draft": doc.get("draft"),
                            "lossless": doc.get("lossless")}
    tested = [k for k, v in pairs.items()
              if isinstance((v["lossless"] or {}).get("sampling"), dict)
              and v["lossless"]["sampling"].get("p_value") is not None]
    alpha = min([pairs[k]["lossless"]["sampling"].get("alpha", 0.01) for k in tested] or [0.01])
    rejected, p_adj = stats.adjusted_p_values([float(pairs[k]["lossless"]["sampling"]["p_value"])
                                               for k in tested], alpha, method)
    adj = dict(zip(tested, zip(rejected, p_adj)))
    for key, pair in pairs.items():
        loss = pair.pop("lossless") or {}
        sampling = loss.get("sampling") or {}
        greedy = loss.get("greedy_lossless")
        pair.update({"greedy_identical": loss.get("greedy_identical"), "greedy_lossless": greedy,
                     "prompts": loss.get("prompts"), "dtype": loss.get("dtype"),
                     "mismatches": len(loss.get("mismatches") or []),
                     "unexplained_mismatches": loss.get("unexplained"),
                     "tie_tolerance": (loss.get("tie_rule") or {}).get("tolerance"),
                     "sampling_test": sampling.get("test"), "sampling_p": sampling.get("p_value"),
                     "sampling_p_adjusted": adj[key][1] if key in adj else None, "alpha": alpha})
        # A greedy comparison the budget cut to no prompt: unchecked, not go on the sampled test alone.
        cut = greedy is None and bool(loss.get("prompts_skipped"))
        if greedy is False or (key in adj and adj[key][0]):
            pair["decision"] = "no-go"
        elif cut or (greedy is None and key not in adj):
            pair["decision"] = "unchecked"
            if cut:
                pair["why"] = (f"the greedy comparison ran on no prompt ({loss['prompts_skipped']} skipped: "
                               "the acceptance stage's budget); a larger budget.shares.acceptance runs it")
        else:
            pair["decision"] = "go"
    decisions = {p["decision"] for p in pairs.values()}
    overall = "no-go" if "no-go" in decisions else "unchecked" if "unchecked" in decisions or not pairs else "go"
    return {"decision": overall, "pairs": pairs}
