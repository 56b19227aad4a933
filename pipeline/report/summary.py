"""The screen that ends `make evaluate`: the release decision and, per target, what to deploy.

    python -m pipeline summary --run runs/smollm2-135m      # what `make evaluate` prints last

Per release variant: its decision and the cell that decided it. Per speculation target: the draft
and k to deploy with the measured speedup and the `vllm serve` line, or "do not speculate". Then
where the full tables are. Reads gate.json and marginal/*.json.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.stage import require_schema
from pipeline.report.format import interval, json_files, number, optional_json
from pipeline.vllm.spec_config import draft_method


def deciding_cell(entry: dict) -> str:
    cells = entry.get("slices", {})
    fails = {s: c for s, c in cells.items() if c["status"] == "fail"}
    if fails:
        s, c = min(fails.items(), key=lambda kv: kv[1]["ci"][1])
        return f"{s} {number(c['diff'], 3)} {interval(c['ci'], 3)}, margin -{c['margin']:g}"
    open_ = {s: c for s, c in cells.items() if c["status"] == "inconclusive"}
    if open_:
        s, c = max(open_.items(), key=lambda kv: kv[1].get("items_to_settle") or 0)
        more = (f"; ~{c['items_to_settle']} items/slice settle it" if c.get("items_to_settle")
                else "; the difference sits on the margin")
        return f"{s} {number(c['diff'], 3)} {interval(c['ci'], 3)} at n={c['n']}{more}"
    if entry.get("missing"):
        return f"missing: {', '.join(entry['missing'])}"
    return f"all {len(cells)} cells pass"


def _best_pair(pairs: dict[str, dict]) -> tuple[str, dict, dict | None] | None:
    """(pair, report, row at its recommended k) of the target's best draft: the largest speedup
    among the pairs that recommend k > 0, else the best speedup seen at any k (k = 0 stays)."""
    paying = [(p, m, next(r for r in m["rows"] if r["k"] == m["recommended_k"])) for p, m in pairs.items()
              if m.get("recommended_k") and m.get("rows")]
    if paying:
        return max(paying, key=lambda x: x[2]["speedup"])
    seen = [(p, m, max(m["rows"], key=lambda r: r["speedup"])) for p, m in pairs.items() if m.get("rows")]
    return max(seen, key=lambda x: x[2]["speedup"]) if seen else None


def _config_line(m: dict, run_dir: Path) -> str | None:
    """A specq-measured pair's speculative_config at its recommended k, as JSON (vLLM's pairs have a serve line)."""
    if not m.get("recommended_k"):
        return None
    base = draft_method(m["draft"], run_dir) if m.get("draft") else None
    full = {**(base if isinstance(base, dict) else {}), "num_speculative_tokens": int(m["recommended_k"])}
    return "speculative_config: " + json.dumps(full, sort_keys=True, separators=(",", ":"))


def summary_data(run_dir: Path) -> dict:
    """What the summary says, as data: the decision; per release variant (name, decision, deciding
    cell); per target a dict (target, deploy, speed, engine, line: the serve line or config,
    speculate, best_seen where it does not); the variants vLLM could not serve."""
    run_dir = Path(run_dir)
    for stage_dir in ("gate", "vllm"):  # marginal's: json_files
        require_schema(run_dir / stage_dir / "meta.json")
    gate = optional_json(run_dir / "gate.json", "gate result") or {}
    out = {"run": run_dir.name, "decision": gate.get("decision"), "reference": gate.get("reference"),
           "confidence": gate.get("confidence", 0.95), "quality": [], "speculation": [], "not_served": []}
    for name in gate.get("release_variants", []):
        entry = gate["variants"][name]
        out["quality"].append((name, entry["decision"], deciding_cell(entry)))
    marginal = json_files(run_dir / "marginal", "*__*.json", "marginal report")
    by_target: dict[str, dict] = {}
    for pair, m in marginal.items():
        by_target.setdefault(pair.split("__")[0], {})[pair] = m
    for target, pairs in sorted(by_target.items()):
        best = _best_pair(pairs)
        if best is None:
            late = any(m.get("not_timed") for m in pairs.values())
            out["speculation"].append({"target": target, "speed": "", "engine": "", "line": None, "speculate": False,
                                       "deploy": ("not timed: the run's budget ran out first (a larger "
                                                  "budget.minutes times it)" if late else "no timed pair")})
            continue
        pair, m, row = best
        draft = pair.split("__", 1)[1]
        spec = {"target": target, "engine": m.get("engine", "specq"), "speculate": bool(m.get("recommended_k")),
                "speed": f"{number(row['speedup'], 2)}x {interval(row['speedup_ci'], 2)}", "line": None}
        if spec["speculate"]:
            by_b = m.get("recommended_k_by_batch")
            batch = (", by batch size " + ", ".join(f"B={b}: {k}" for b, k in sorted(by_b.items(), key=lambda x: int(x[0])))
                     if by_b and len(set(by_b.values())) > 1 else "")
            spec["deploy"] = f"{draft} k = {m['recommended_k']}{batch}"
            spec["line"] = m.get("serve_command") or _config_line(m, run_dir)
        else:
            spec["deploy"] = f"do not speculate (best seen: {draft} k = {row['k']})"
            spec["best_seen"] = f"{draft} k = {row['k']}"
        out["speculation"].append(spec)
    vmeta = optional_json(run_dir / "vllm" / "meta.json", "vllm meta.json") or {}
    out["not_served"] = sorted(k for k in (vmeta.get("skipped") or {}) if "__" not in k)
    return out


def summary_lines(run_dir: Path) -> list[str]:
    run_dir = Path(run_dir)
    d = summary_data(run_dir)
    out = [f"specq: {d['run']}: release decision {str(d['decision'] or 'not decided').upper()}", ""]
    if d["decision"]:
        out.append(f"Quality, each release variant against {d['reference']} "
                   f"(margin per slice; {int(round(d['confidence'] * 100))}% CIs):")
        out += [f"  {name:<14} {decision:<13} {cell}" for name, decision, cell in d["quality"]]
        out.append("")
    if d["speculation"]:
        out.append("Speculation, per target (speedup over plain decoding at B = 1, greedy, 95% CI):")
    for r in d["speculation"]:
        if r.get("best_seen"):
            out.append(f"  {r['target']:<14} do not speculate (best seen: {r['best_seen']}, {r['speed']}, {r['engine']})")
        elif not r["speed"]:
            out.append(f"  {r['target']:<14} {r['deploy']}")
        else:
            out.append(f"  {r['target']:<14} {r['deploy']}: {r['speed']} (measured in {r['engine']})")
            if r["line"]:
                out.append(f"      {r['line']}")
    if d["not_served"]:
        out.append(f"  not measured in vLLM: {', '.join(d['not_served'])} (vLLM cannot serve them here)")
    out += ["", f"Report:     {run_dir / 'report' / 'index.html'}  (and gate.json beside report/)",
            f"Per pair:   {run_dir / 'marginal'}/<target>__<draft>.md",
            f"Full table: specq gate --table --run {run_dir}"]
    return out


def summary_blocks(run_dir: Path) -> list:
    """The summary as the report's first blocks: a table per question, then the lines to deploy."""
    d = summary_data(run_dir)
    out: list = [("h2", "Summary")]
    if d["quality"]:
        out += [("p", f"Quality, each release variant against `{d['reference']}` "
                      f"(margin per slice; {int(round(d['confidence'] * 100))}% CIs):"),
                ("table", ["variant", "decision", "the cell that decided it"],
                 [[n, dec, cell] for n, dec, cell in d["quality"]], [[None, dec, None] for _, dec, _ in d["quality"]])]
    if d["speculation"]:
        out += [("p", "Speculation, per target (speedup over plain decoding at B = 1, greedy, 95% CI):"),
                ("table", ["target", "deploy", "speedup", "measured in"],
                 [[r["target"], r["deploy"], r["speed"], r["engine"]] for r in d["speculation"]], None)]
        lines = [f"# {r['target']}\n{r['line']}" for r in d["speculation"] if r["line"]]
        if lines:
            out.append(("code", "\n".join(lines)))
    if d["not_served"]:
        out.append(("p", f"Not measured in vLLM: {', '.join(d['not_served'])} (vLLM cannot serve them here)."))
    return out
