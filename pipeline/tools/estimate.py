"""What a run costs: each stage's wall time for a config, a model shape and a device, from a cost
model whose every constant is named with its source (the devices' in pipeline/tools/cost_devices.py).

    python -m pipeline.tools.estimate --config configs/gpu.yaml --shape 8b --device h100
    python -m pipeline.tools.estimate --config configs/gpu.yaml --shape 8b --device h100 --minutes 120
    python -m pipeline.tools.estimate --config configs/default.yaml --shape smollm2-135m --device cpu-2core \\
        --json estimate.json

An estimate, not a measurement: each stage sums its forwards (pipeline/tools/cost_model.py) from the
config's own numbers and the plans the stages make, exhaustive and under the budget (never below a
planning stage's floor). Floors, warm-ups and every other assumption: docs/methods/budget.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pipeline.core.budget import allot, fmt_s
from pipeline.core.config import ConfigError, load_config
from pipeline.decode.compiled import graph_groups
from pipeline.latency.memory import cache_len, plan_grid
from pipeline.latency.plan import batched_shapes, draft_label, speculative_shapes, why_not_screened
from pipeline.latency.screen import timed_prefix
from pipeline.latency.speculative import MIN_TIMING_REPEATS, WARMUP_TOKENS
from pipeline.speculation.measure import MIN_DIRECT_PROMPTS
from pipeline.tools.cost_devices import (BUILTIN_CALIBRATION_TOKENS, DEVICES, DYNAMIC_COMPILE_FACTOR, Device,
                                        gptq_scale)
from pipeline.tools.cost_model import (ACCEPTANCE_RATE, CHARS_PER_TOKEN, SCREEN_PROBE_S, SCREEN_RATE_MARGIN, SHAPES,
                                       Cost, Stage, prompt_lengths)
from pipeline.tools.estimate_quality import quality  # quality's part: its slices, waves and lm-eval tasks

REPO = Path(__file__).resolve().parents[2]
STAGES = ("prepare", "quantize", "drafts", "acceptance", "latency", "quality", "marginal", "gate", "report")

MARGINAL_S_PER_PAIR, GATE_S, REPORT_S = 20.0, 10.0, 30.0  # CPU work (docs/results/2026-12-03-run-costs.md: a minute, seconds)


# ---------------------------------------------------------------- the stages


def prepare(c: Cost) -> Stage:
    st, size = Stage("prepare"), c.params * (4 if c.cfg.prepare.dtype == "float32" else 2)
    st.add("start", c.dev.start_s)
    st.add(f"read + write the reference, {size / 1e9:.1f} GB", 2 * size / c.dev.disk)
    return st


def quantize(c: Cost) -> Stage:
    st, cal = Stage("quantize"), c.cfg.quantize.calibration
    st.add("start", c.dev.start_s)
    windows = cal.n_samples  # the built-in text holds fewer non-overlapping windows than gpu.yaml asks
    if cal.source == "builtin":
        windows = min(windows, BUILTIN_CALIBRATION_TOKENS // cal.max_tokens)
    tokens, load = max(windows, 1) * cal.max_tokens, c.load(c.cfg.quantize.reference)
    for name, v in c.cfg.quantize.variants.items():
        if v.scheme == "checkpoint":
            st.add(f"{name}: check and link a checkpoint", 5.0)
        elif v.scheme == "gptq":
            st.add(f"{name}: GPTQ on {tokens} calibration tokens, load and save",
                   c.dev.gptq_s_per_param * c.params * gptq_scale(tokens) + load + c.load(name))
        else:
            work = 0.0 if v.scheme == "none" else c.dev.quantize_other_s
            st.add(f"{name}: {v.scheme}, load and save", work + load + c.load(name))
    return st


def drafts(c: Cost) -> Stage:
    st = Stage("drafts")
    st.add("start, load the reference", c.dev.start_s + c.load(c.cfg.quantize.reference))
    for spec in c.cfg.drafts:
        st.add(spec, 5.0 if spec.split(":")[0] in ("layerskip", "hf") else 1.0)
    return st


def acceptance(c: Cost) -> Stage:
    st, acc = Stage("acceptance"), c.cfg.acceptance
    lengths, temps, new = prompt_lengths(c, "acceptance"), len(acc.temperatures), acc.max_new_tokens
    ks = sorted({k for k in acc.direct_check_k if 1 <= k <= acc.k_max})
    st.add("start", c.dev.start_s)
    for target in acc.targets or [c.cfg.quantize.reference]:
        st.add(f"{target}: texts, {temps} temperatures x {len(lengths)} prompts x {new} tokens",
               c.load(target) + temps * sum(c.generate(target, 1, p, new) for p in lengths))
        for spec in c.cfg.drafts:
            forced = sum(c.forward(target, 1, p + new, 0) + (0.0 if spec.startswith("ngram") else
                                                              c.draft(spec, target, 1, p + new, 0)) for p in lengths)
            m, p0 = acc.lossless_samples, lengths[0]  # a batched prefill, then m (verify + draft step)s
            lossless = c.forward(target, m, p0, 0) + m * (c.decode_step(target, 1, p0)
                                                          + c.draft(spec, target, 1, 1, p0))
            st.add(f"{target} + {spec}: teacher forcing, lossless check", temps * forced + lossless)
            # Its first MIN_DIRECT_PROMPTS prompt(s) run whatever the budget (the greedy lossless
            # check is made on them); the budget bounds the rest.
            first, others = lengths[:MIN_DIRECT_PROMPTS], lengths[MIN_DIRECT_PROMPTS:]
            st.add(f"{target} + {spec}: direct check at k = {', '.join(map(str, ks))}, first prompt",
                   temps * sum(c.speculate(target, spec, 1, p, new, k) for k in ks for p in first))
            if others:
                st.add(f"{target} + {spec}: direct check at k = {', '.join(map(str, ks))}, "
                       f"{len(others)} more prompts",
                       temps * sum(c.speculate(target, spec, 1, p, new, k) for k in ks for p in others), floor=False)
    return st


def _cut_note(target: str, spec: str, where: str, pair_ks: list[int], ks: list[int]) -> str:
    return (f"latency: {target} + {spec} at {where} predicted timed at k = {min(pair_ks)}..{max(pair_ks)} of "
            f"{min(ks)}..{max(ks)} (the screen's bound is below 1 past k = {max(pair_ks)} at the guessed acceptance "
            "rate + 0.1); the stage decides on acceptance's measured CI")


def _screened_note(target: str, spec: str, where: str, bound: float) -> str:
    return (f"latency: {target} + {spec} at {where} predicted screened out (speedup bound {bound:.2f} < 1 at the "
            f"guessed acceptance rate + {SCREEN_RATE_MARGIN:g}); the stage decides on acceptance's measured CI")


def _compiles(shapes, lat, d) -> tuple[int, float]:
    """(graphs, seconds) a session spends compiling `shapes`: a graph each, or one per width group
    with dynamic widths (pipeline/decode/compiled.py), whose other widths only record a CUDA graph."""
    groups = graph_groups(shapes, lat.compile_dynamic_width).values()
    seconds = sum(d.compile_s if len(g) == 1 else DYNAMIC_COMPILE_FACTOR * d.compile_s + (len(g) - 1) * d.record_s
                  for g in groups)
    return len(groups), seconds


def latency(c: Cost) -> Stage:
    st, lat, cfg, d = Stage("latency"), c.cfg.latency, c.cfg, c.dev
    k_max = lat.k_max or cfg.vllm.k_max or cfg.acceptance.k_max
    ks = range(1, k_max + 1)
    compiled = bool(lat.compile and d.cuda and lat.compile_backend in ("auto", "inductor"))
    eager, later = not compiled, 0.0  # later: every loop's repeats after its first
    st.add("start, bandwidth", d.start_s + 5.0)
    for name in cfg.quantize.variants:  # the plain grids: the memory plan's cells, one graph each
        free = d.memory - max(1 << 30, 0.05 * d.memory) - c.held_bytes(name)
        fits = [x for x in lat.context_lengths if x + lat.new_tokens <= c.context]
        plan = plan_grid(c.shape(name), lat.batch_sizes, fits, lat.new_tokens, free, "cuda" if d.cuda else "cpu",
                         cuda_graphs=compiled)
        one = sum(c.generate(name, x.batch, x.context, lat.new_tokens, eager=eager) for x in plan.cells)
        graphs = len(plan.cells) if compiled else 0
        st.add(f"{name}: grid of {len(plan.cells)} cells: load, compile {graphs} graphs, warm-up + 1 repeat",
               c.load(name) + graphs * d.compile_s + (lat.warmup + 1) * one)
        st.add(f"{name}: grid repeats 2-{lat.repeats}", (lat.repeats - 1) * one, floor=False)
        later += (lat.repeats - 1) * one
        if plan.dropped:
            st.notes.append(f"latency: the memory plan drops {len(plan.dropped)} of {name}'s grid cells")
    spec_lengths = prompt_lengths(c, "latency", lat.speculative_prompts_per_kind or None)
    row_len = min(prompt_lengths(c, "latency", 1))  # batched rows are cut to the shortest prompt's length
    warm_new = min(lat.new_tokens, WARMUP_TOKENS)  # a B = 1 or batched warm-up's run (module docstring)
    temps, sizes = len(cfg.acceptance.temperatures), sorted(set(lat.spec_batch_sizes))
    floor_reps = min(MIN_TIMING_REPEATS, lat.repeats)  # a timed pair's repeats whatever the budget
    reps_word = "1 repeat" if floor_reps == 1 else f"{floor_reps} repeats"
    loops = list(lat.closed_loop_batch_sizes) if lat.closed_loop_waves > 0 else []
    lens = {b: cache_len(row_len, max(lat.new_tokens, lat.closed_loop_tokens)) for b in sizes + loops}
    for target in cfg.acceptance.targets or [cfg.quantize.reference]:
        labels = [draft_label(s) for s in cfg.drafts if not s.startswith("ngram")]
        graphs, secs = (_compiles(speculative_shapes(cache_len(max(spec_lengths), lat.new_tokens), k_max, labels),
                                  lat, d) if compiled else (0, 0.0))
        st.add(f"{target}: B = 1 pairs: load, compile {graphs} graphs", c.load(target) + secs)
        target_graphs = _compiles(batched_shapes(lens, k_max, []), lat, d) if compiled else (0, 0.0)
        st.add(f"{target}: batched pairs: load, compile the target's {target_graphs[0]} graphs",
               c.load(target) + target_graphs[1])
        # The stage's own rule (an inductor run is not screened, on any device); only the device's kind is read.
        screening = why_not_screened(lat, torch.device("cuda" if d.cuda else "cpu")) is None
        for spec in cfg.drafts:
            # The stage screens a model draft where its steps run eagerly (plan.why_not_screened); a
            # pair it screens out is probed, not timed. Here the verdict is predicted (screen_bound).
            screened = screening and not spec.startswith("ngram")
            probe = SCREEN_PROBE_S if screened else 0.0
            bounds = c.screen_bounds(target, spec, 1, sum(spec_lengths) / len(spec_lengths) + lat.new_tokens / 2,
                                     ks) if screened else None
            bound = max(bounds.values()) if bounds else None
            pair_ks = timed_prefix(ks, [bounds] if bounds else [])  # the k a pair that may pay is timed at
            if len(pair_ks) < len(ks):
                st.notes.append(_cut_note(target, spec, "B = 1", pair_ks, ks))
            one = temps * sum(c.generate(target, 1, p, lat.new_tokens, eager=eager)
                              + sum(c.speculate(target, spec, 1, p, lat.new_tokens, k, eager) for k in pair_ks)
                              for p in spec_lengths)
            p0 = min(spec_lengths)  # a warm-up: per temperature, plain and every k once on the shortest prompt
            warm = lat.warmup * temps * (c.generate(target, 1, p0, warm_new, eager=eager)
                                         + sum(c.speculate(target, spec, 1, p0, warm_new, k, eager) for k in pair_ks))
            if bound is not None and bound < 1:
                st.add(f"{target} + {spec}: B = 1 probe; predicted screened out (bound {bound:.2f})", probe)
                st.notes.append(_screened_note(target, spec, "B = 1", bound))
            else:
                # A pair the screen keeps is warmed up and timed MIN_TIMING_REPEATS times whatever the budget:
                # a k is recommended from that many repeats on (the stage's budget stops only later ones).
                st.add(f"{target} + {spec}: B = 1 {'screen, ' if screened else ''}warm-up + {reps_word}",
                       probe + warm + floor_reps * one)
                if lat.repeats > floor_reps:
                    st.add(f"{target} + {spec}: B = 1 repeats {floor_reps + 1}-{lat.repeats}",
                           (lat.repeats - floor_reps) * one, floor=False)
                later += (lat.repeats - 1) * one
            # The batched phase's session is the target's (pipeline/stages/latency.py): its graphs
            # compile with the first pair, each draft's own widths with its pair.
            labels = [] if spec.startswith("ngram") else [draft_label(spec)]
            graphs, secs = (0, 0.0)
            if compiled:  # the draft's own graphs: the pair's session less the target's
                g1, s1 = _compiles(batched_shapes(lens, k_max, labels), lat, d)
                graphs, secs = g1 - target_graphs[0], s1 - target_graphs[1]
            by_b = ([c.screen_bounds(target, spec, b, row_len + lat.new_tokens / 2, ks) for b in sizes]
                    if screened else [])
            bound = max(max(x.values()) for x in by_b) if by_b else None
            pair_ks = timed_prefix(ks, by_b)
            if len(pair_ks) < len(ks):
                st.notes.append(_cut_note(target, spec, "every batch size", pair_ks, ks))
            if bound is not None and bound < 1:
                st.add(f"{target} + {spec}: batched probe; predicted screened out (bound {bound:.2f})", probe)
                st.notes.append(_screened_note(target, spec, "every batch size", bound))
                continue

            def cells(new: int) -> float:  # every batched cell once: plain and every timed k at each B
                return sum(c.generate(target, b, row_len, new, eager=eager)
                           + sum(c.speculate(target, spec, b, row_len, new, k, eager) for k in pair_ks) for b in sizes)
            cell = cells(lat.new_tokens)
            tokens, wave = lat.closed_loop_tokens, 0.0
            for b in loops:  # one wave at each B: plain and speculative at the fastest k
                fastest = min(c.speculate(target, spec, b, row_len, tokens, k, eager) for k in pair_ks)
                wave += c.generate(target, b, row_len, tokens, eager=eager) + fastest
            # As at B = 1, the warm-up and the first MIN_TIMING_REPEATS repeats run whatever the budget, and
            # with repeat r the closed loop's waves r, r + R, ... (pipeline/latency/batched.py spreads the
            # waves over the repeats and checks the budget only for those left after the last repeat).
            first_waves = sum(1 for w in range(lat.closed_loop_waves) if w % lat.repeats < floor_reps)
            st.add(f"{target} + {spec}: batched: compile {graphs} graphs, warm-up + {reps_word}, {first_waves} "
                   f"closed-loop wave(s)", probe + secs + lat.warmup * cells(warm_new) + floor_reps * cell
                   + first_waves * wave)
            if lat.repeats > floor_reps or lat.closed_loop_waves > first_waves:
                st.add(f"{target} + {spec}: batched: repeats {floor_reps + 1}-{lat.repeats}, the other closed-loop "
                       "waves", (lat.repeats - floor_reps) * cell + (lat.closed_loop_waves - first_waves) * wave,
                       floor=False)
            later += (lat.repeats - 1) * cell
    if lat.settle and lat.min_repeats < lat.repeats:
        st.notes.append(f"latency: a loop that settles stops from {lat.min_repeats} of {lat.repeats} repeats on: "
                        f"if every loop did, {fmt_s(later * (lat.repeats - lat.min_repeats) / (lat.repeats - 1))} less")
    return st


def rest(c: Cost) -> list[Stage]:
    marginal, gate, report = Stage("marginal"), Stage("gate"), Stage("report")
    pairs = len(c.cfg.acceptance.targets or [c.cfg.quantize.reference]) * len(c.cfg.drafts)
    marginal.add(f"{pairs} pairs: tables, serving simulation", MARGINAL_S_PER_PAIR * pairs)
    gate.add("the decision", GATE_S)
    report.add("HTML and Markdown", REPORT_S)
    return [marginal, gate, report]


def plans_run(cfg, device: Device) -> bool:
    """Whether a run of `cfg` on `device` shares its planning stages' time around their floors (the
    run's plan, pipeline/core/budget.py: allot): where the run makes one (pipeline/tools/run_plan.py:
    a GPU the cost model has a profile for, budget.rebalance on); on a CPU it takes the shares."""
    return bool(cfg.budget.minutes and cfg.budget.rebalance and device.cuda)


def estimate(cfg, shape, device: Device) -> dict:
    """Every stage's exhaustive estimate, its floor, its budget cap and the budgeted estimate (seconds).
    `shape`: a name in SHAPES or a LlamaConfig-style dict (a model's own, pipeline/tools/run_plan.py)."""
    c, b = Cost(cfg, shape, device), cfg.budget
    stages = [prepare(c), quantize(c), drafts(c), acceptance(c), latency(c), quality(c), *rest(c)]
    shares = {st.name: b.shares[st.name] for st in stages if b.minutes and st.name in b.shares}
    caps = {name: b.minutes * 60 * share for name, share in shares.items()}
    plan = None
    if shares and plans_run(cfg, device):
        floors = {st.name: st.floor for st in stages if st.name in shares}
        plan = allot(sum(caps.values()), shares, floors)
    rows = []
    for st in stages:
        cap = caps.get(st.name)
        if cap is not None and st.floor > cap:
            st.notes.append(f"{st.name}: what it does whatever the budget ({fmt_s(st.floor)}) is over its "
                            f"share ({fmt_s(cap)})")
        if plan is not None and st.name in plan:
            if abs(plan[st.name] - cap) > 1.0:
                st.notes.append(f"{st.name}: the run's plan gives it {fmt_s(plan[st.name])} instead of its share's "
                                f"{fmt_s(cap)} (the planning stages' time shared around their floors)")
            cap = plan[st.name]
        rows.append({"stage": st.name, "exhaustive_s": round(st.seconds, 1), "floor_s": round(st.floor, 1),
                     "cap_s": None if cap is None else round(cap, 1),
                     "share_s": None if st.name not in caps else round(caps[st.name], 1),
                     "budgeted_s": round(st.seconds if cap is None else min(st.seconds, max(cap, st.floor)), 1),
                     "parts": [{"what": w, "seconds": round(s, 1), "floor": f} for w, s, f in st.parts],
                     "notes": st.notes})
    if plan is not None and sum(r["floor_s"] for r in rows if r["stage"] in plan) > sum(caps.values()):
        rows[-1]["notes"].append(
            f"budget: the planning stages' floors ({fmt_s(sum(r['floor_s'] for r in rows if r['stage'] in plan))}) "
            f"are over their time ({fmt_s(sum(caps.values()))}): each gets its floor")
    d = device
    return {"shape": shape if isinstance(shape, str) else "the model's config", "params": c.params,
            "device": d.name, "device_label": d.label,
            "budget_minutes": b.minutes, "shares": dict(b.shares) if b.minutes else None,
            "planned": plan is not None,
            "constants": {"bandwidth_Bps": d.bandwidth, "flops": d.flops, "source": d.source,
                          "bandwidth_eff": d.bw_eff, "flops_eff": d.flops_eff, "eager_layer_s": d.eager_layer_s,
                          "compile_s_per_graph": d.compile_s, "cuda_graph_record_s": d.record_s,
                          "dynamic_compile_factor": DYNAMIC_COMPILE_FACTOR, "disk_Bps": d.disk, "slowdown": d.slowdown,
                          "acceptance_rate": ACCEPTANCE_RATE, "chars_per_token": CHARS_PER_TOKEN},
            "stages": rows,
            "total": {key: round(sum(r[key] for r in rows), 1) for key in ("exhaustive_s", "floor_s", "budgeted_s")}}


def render(doc: dict, config: str) -> str:
    b = doc["budget_minutes"]
    lines = [f"specq run estimate: {config}, shape {doc['shape']} ({doc['params'] / 1e9:.2f}B parameters), "
             f"device {doc['device']} ({doc['device_label']})"
             + (f"\n{doc['constants']['source']}" if "measured" in doc["constants"] else ""),
             f"budget: {b:g} min; shares " + ", ".join(f"{k} {v:g}" for k, v in doc["shares"].items()) if b
             else "budget: none (budget.minutes null): the exhaustive run",
             *(["the run's plan: acceptance, latency and quality share their time around their floors "
                "(budget.rebalance; the cap column is the plan's)"] if doc.get("planned") else []),
             f"{'stage':<11} {'exhaustive':>10} {'budget cap':>10} {'budgeted':>10}  largest part"]
    for r in doc["stages"]:
        top = max(r["parts"], key=lambda p: p["seconds"])
        lines.append(f"{r['stage']:<11} {fmt_s(r['exhaustive_s']):>10} {fmt_s(r['cap_s']):>10} "
                     f"{fmt_s(r['budgeted_s']):>10}  {top['what']} ({fmt_s(top['seconds'])})")
    t = doc["total"]
    lines.append(f"{'total':<11} {fmt_s(t['exhaustive_s']):>10} {'':>10} {fmt_s(t['budgeted_s']):>10}")
    return "\n".join(lines + [f"note: {n}" for r in doc["stages"] for n in r["notes"]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--shape", default="8b", help=f"one of: {', '.join(SHAPES)}")
    ap.add_argument("--device", default="h100",
                    help=f"one of: {', '.join(DEVICES)}, or here (this CPU, timed: pipeline/tools/cost_here.py)")
    ap.add_argument("--minutes", type=float, help="budget.minutes for this estimate, instead of the config's")
    ap.add_argument("--json", help="write the estimate here: every stage's parts, notes and the constants")
    args = ap.parse_args(argv)
    for flag, value, known in (("device", args.device, [*DEVICES, "here"]), ("shape", args.shape, SHAPES)):
        if value not in known:
            print(f"estimate: unknown --{flag} '{value}' (known: {', '.join(known)})", file=sys.stderr)
            return 2
    if args.minutes is not None and not args.minutes > 0:
        print(f"estimate: --minutes must be > 0 (got {args.minutes:g})", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"estimate: {e}", file=sys.stderr)
        return 2
    if args.minutes is not None:
        cfg = cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"minutes": args.minutes})})
    device, measured = DEVICES.get(args.device), None
    if args.device == "here":
        from pipeline.tools.cost_here import measure
        print(f"estimate: timing a float32 {args.shape} on this CPU (decode step, prefill)...", file=sys.stderr)
        device, measured = measure(SHAPES[args.shape])
    doc = estimate(cfg, args.shape, device)
    if measured:
        doc["constants"]["measured"] = {k: round(v, 6) if isinstance(v, float) else v for k, v in measured.items()}
    print(render(doc, args.config))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
