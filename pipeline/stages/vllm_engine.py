"""The vllm stage: speculation measured in vLLM, the engine the user serves with.

    python -m pipeline vllm --run runs/smollm2-135m --config configs/default.yaml

For each target (vllm.targets; default every release variant vLLM can serve here) it starts a plain
engine, then one per (draft, k), and sends the acceptance workload through each
(pipeline/latency/served.py). Writes vllm/<target>.json (the baseline) and vllm/<target>__<draft>.json
(per k: vLLM's acceptance counts, latency, the lossless checks; the recommended speculative_config,
checked under open-loop load: pipeline/serving/served_k.py). Under a budget an engine starts only
when its measured cost fits, every pair's k = 1 first; each (pair, k) is an item, so a re-run
resumes (docs/methods/vllm-engine.md).
"""
from __future__ import annotations

import time

from draft_models.registry import draft_slug
from pipeline.core.budget import StageBudget, fmt_s
from pipeline.core.stage import StageContext, StageError, progress, read_json
from pipeline.latency.served import (Settings, b1_records, measure, open_loop_run, sampled_texts, serve,
                                     serve_reason)
from pipeline.serving.served_k import b1_check, engine_tables, open_loop_verdict, recommend
from pipeline.speculation.engine_stats import greedy_lossless, latency_summary, sampled_lossless, summarize_requests
from pipeline.speculation.lossless import LOSSLESS_ALPHA, LOSSLESS_TEMPERATURE
from pipeline.speculation.measure import temp_key
from pipeline.speculation.workload import workload_prompts, workload_summary
from pipeline.stages.targets import vllm_targets
from pipeline.vllm.env import engine_info, speculation_engine, unavailable
from pipeline.vllm.server import EngineStartError
from pipeline.vllm.spec_config import draft_method, eager, speculative_config


def precheck(config, args: dict | None = None) -> None:
    """Before any work: vLLM asked for and not installed, or an unknown target, is one line."""
    if config.speculation_engine == "vllm":
        why = unavailable()
        if why:
            raise StageError(f"speculation_engine vllm: {why}")
    known = config.quantize.variants
    for t in config.vllm.targets or []:
        if t not in known:
            raise StageError(f"vllm.targets: unknown variant '{t}' (variants: {', '.join(known)})")


def settings_for(config, platform: str) -> Settings:
    v, acc = config.vllm, config.acceptance
    conc = list(v.concurrency)
    return Settings(platform=platform, dtype="bfloat16" if v.dtype == "auto" else v.dtype,
                    max_model_len=v.max_model_len, seed=config.seed,
                    enforce_eager=eager(platform, v.enforce_eager),
                    max_num_seqs=max([8, *conc]) * 2, max_new_tokens=acc.max_new_tokens,
                    temperatures=list(acc.temperatures), top_k=acc.sampling.top_k, top_p=acc.sampling.top_p,
                    concurrency=sorted(set(conc)), tensor_parallel_size=v.tensor_parallel_size,
                    gpu_memory_utilization=v.gpu_memory_utilization, kv_cache_gib=v.kv_cache_gib,
                    startup_timeout_s=v.startup_timeout_s, request_timeout_s=v.request_timeout_s,
                    extra_args=dict(v.engine_args))


class _Engines:
    """Starts engines for one run: settings, logs, the progress lines, and what an engine costs."""

    def __init__(self, ctx: StageContext, settings: Settings, prompts: dict, budget: StageBudget):
        self.ctx, self.settings, self.prompts, self.budget = ctx, settings, prompts, budget
        self.logs = ctx.out_dir / "logs"
        self.started: list[dict] = []

    def fits(self, what: str, target: str | None = None, engines: int = 1) -> bool:
        """Whether `engines` more engines fit the budget, each costing the mean start so far plus the
        work of the target's engines (the best guess for a speculative one on the same prompts); the
        first engine always runs. A skip is recorded."""
        if not self.started:
            return True
        work = [e["total_s"] - e["start_s"] for e in self.started
                if target is None or e["engine"] == target or e["engine"].startswith(f"{target}__")]
        work = work or [e["total_s"] - e["start_s"] for e in self.started]
        estimate_s = engines * (sum(e["start_s"] for e in self.started) / len(self.started) + max(work))
        if self.budget.affords(estimate_s):
            return True
        self.budget.skip(what, f"budget: {fmt_s(max(self.budget.left(), 0.0))} left, an engine here takes "
                               f"~{fmt_s(estimate_s)} (start and work, measured on this stage's engines)")
        return False

    def run(self, name: str, vdir, spec: dict | None, work):
        t0 = time.time()
        with serve(self.settings, vdir, spec, self.logs / f"{name}.log", name) as srv:
            progress(f"vllm: {name}: engine up in {srv.start_s:.0f} s")
            out = work(srv.url)
        self.started.append({"engine": name, "start_s": round(srv.start_s or 0.0, 1),
                             "total_s": round(time.time() - t0, 1)})
        return out, srv.start_s

    def b1_progress(self, name: str):
        last = [time.time()]

        def tick(done: int, total: int, t: str) -> None:
            if time.time() - last[0] >= 30 and done < total:
                last[0] = time.time()
                progress(f"vllm: {name}: T={t} request {done}/{total}")
        return tick


def _measure(eng: _Engines, name: str, vdir, acc, spec: str | None = None, k: int = 0, last: bool = False) -> dict:
    """One engine over the workload: the plain one (k = 0) with its closed-loop capacity and open-loop
    runs, or the pair's at k; the lossless test's samples on the plain engine and at the pair's k_max."""
    s, cfg = eng.settings, eng.ctx.config
    ids = next(iter(eng.prompts.values()))[0][1]
    config = speculative_config(spec, k, eng.ctx.run_dir) if k else None

    def work(url):
        out = {"measure": measure(url, eng.prompts, s, k, progress=eng.b1_progress(f"{name} k={k}" if k else name))}
        out["samples"] = (sampled_texts(url, ids, acc.lossless_samples, LOSSLESS_TEMPERATURE, s.seed + (1 if k else 0),
                                        timeout_s=s.request_timeout_s) if last or not k else None)
        if not k:  # requests/s of the largest closed loop at the first temperature
            top = str(max(s.concurrency, default=0))
            capacity = out["capacity_rps"] = (out["measure"]["closed_loop"][top][temp_key(s.temperatures[0])]
                                              .get("requests_per_s") if s.concurrency else None)
            out["open_loop"] = [open_loop_run(url, eng.prompts, s, f * capacity, cfg.vllm.open_loop.requests, s.seed,
                                              cfg.serving.slo_ttft_ms, cfg.serving.slo_tpot_ms)
                                for f in cfg.vllm.open_loop.loads] if cfg.vllm.open_loop_check and capacity else []
        return out
    out, start_s = eng.run(f"{name}.k{k}" if k else name, vdir, config, work)
    if k:
        return {"k": k, "speculative_config": config, "engine_start_s": start_s, **out}
    return {"variant": name, "engine_start_s": start_s, **out,
            "latency": {t: latency_summary(recs) for t, recs in out["measure"]["b1"].items()}}


def _summarize_k(part: dict, plain: dict, confidence: float) -> dict:
    k, m = part["k"], part["measure"]
    out = {"speculative_config": part["speculative_config"], "engine_start_s": part["engine_start_s"],
           "b1": {}, "closed_loop": m["closed_loop"], "counters": m["counters"], "summary": {}, "latency": {},
           "lossless": {}}
    for t, recs in m["b1"].items():
        out["latency"][t] = latency_summary(recs)
        for cat in ["all", *dict.fromkeys(r["category"] for r in recs)]:
            out["summary"].setdefault(cat, {})[t] = summarize_requests(
                recs if cat == "all" else [r for r in recs if r["category"] == cat], k, confidence)
    if "0.0" in m["b1"] and "0.0" in plain["measure"]["b1"]:
        outputs = [{r["id"]: {"output": r["output"], "logprobs": r.get("logprobs")} for r in b1["0.0"]}
                   for b1 in (plain["measure"]["b1"], m["b1"])]
        out["lossless"]["greedy"] = greedy_lossless(*outputs)
    if part.get("samples"):
        out["lossless"]["sampled"] = {"temperature": LOSSLESS_TEMPERATURE,
                                      **sampled_lossless(plain["samples"], part["samples"], LOSSLESS_ALPHA)}
    for recs in m["b1"].values():
        for r in recs:
            r.pop("logprobs", None)
    out["b1"] = m["b1"]
    return out


def _validate(eng: _Engines, name: str, vdir, plain: dict, rec: dict, tables: dict, confidence: float) -> dict:
    """Open loop at the plain engine's loads: the recommended config, and the best fixed k where it
    differs; each config is started exactly as written (so it is shown to start)."""
    cfg = eng.ctx.config
    rates = [x["rate"] for x in plain.get("open_loop") or []]
    configs = {"recommended": rec["speculative_config"]}
    if rec.get("best_fixed_config") and rec["best_fixed_config"] != rec["speculative_config"]:
        configs["best_fixed_k"] = rec["best_fixed_config"]
    out = {"rates": rates, "plain": plain.get("open_loop") or [], "configs": {}}
    t = rec["primary_temperature"]
    for label, config in configs.items():
        def work(url, config=config, label=label):
            # The recommended config's own B = 1 speedup, on the same prompts: within the report's CI?
            # (None where it drafts nothing at B = 1: a schedule with k = 0 there, k > 0 at larger B.)
            b1 = (b1_records(url, eng.prompts, eng.settings, float(t), rec["recommended_k"], eng.settings.seed * 1000)
                  if label == "recommended" and rec["recommended_k"] > 0 else None)
            return b1, [open_loop_run(url, eng.prompts, eng.settings, r, cfg.vllm.open_loop.requests, eng.settings.seed,
                                      cfg.serving.slo_ttft_ms, cfg.serving.slo_tpot_ms) for r in rates]
        try:
            (b1, runs), start_s = eng.run(f"{name}.{label}", vdir, config, work)
        except EngineStartError as e:  # the config as written does not start: that is the finding
            progress(f"vllm: {name}: the {label} config did not start: {e}")
            out["configs"][label] = {"speculative_config": config, "started": False, "error": str(e)}
            continue
        out["configs"][label] = {"speculative_config": config, "started": True, "engine_start_s": start_s,
                                 "runs": runs}
        if b1 is not None:
            out["b1_check"] = b1_check(plain, b1, rec, tables, t, confidence)
    if "best_fixed_k" not in out["configs"] and "runs" in out["configs"]["recommended"]:
        out["configs"]["best_fixed_k"] = {**out["configs"]["recommended"], "same_as": "recommended"}
    out["verdict"] = open_loop_verdict(out)
    return out


def run(ctx: StageContext) -> None:
    engine, why = speculation_engine(ctx.config)
    ctx.meta["engine"] = engine
    if engine == "specq":
        ctx.meta["reason"] = why
        progress(f"vllm: not run ({why}); speculation is measured by specq's engine")
        return
    from transformers import AutoTokenizer

    info = engine_info()
    ctx.meta["vllm"] = info
    s = settings_for(ctx.config, info["platform"])
    acc = ctx.config.acceptance
    confidence = ctx.config.confidence
    k_max = ctx.config.vllm.k_max or acc.k_max
    tok = AutoTokenizer.from_pretrained(ctx.run_dir / "model")
    prompts = workload_prompts(ctx.config, tok, "vllm", context=s.max_model_len)
    timeouts = ("python", "startup_timeout_s", "request_timeout_s")  # not what is measured
    common = {"settings": {k: v for k, v in vars(s).items() if k not in timeouts}, "vllm": info.get("vllm"),
              "workload": workload_summary(prompts), "acceptance": {"lossless_samples": acc.lossless_samples}}
    measured, skipped, recs = {}, {}, {}
    budget = StageBudget(ctx.config, "vllm", run_dir=ctx.run_dir)
    eng = _Engines(ctx, s, prompts, budget)
    progress(f"vllm: vLLM {info.get('vllm')} ({info.get('platform')}), {sum(map(len, prompts.values()))} prompts x "
             f"{len(s.temperatures)} temperatures, k = 1..{k_max}, closed loops at {s.concurrency or 'none'}")
    budget.announce("a plain engine per target, then each pair at k = 1, 2, ... while an engine fits (its cost "
                    "measured on the engines before it), then the open-loop check", None)

    # 1. Each target's plain engine: the baseline every pair is timed against.
    plains = {}
    for target in vllm_targets(ctx.config):
        vdir = ctx.run_dir / "variants" / target
        vmeta = read_json(vdir / "meta.json", f"variant '{target}' meta.json")
        reason = serve_reason(vdir, info["platform"])
        if reason:
            skipped[target] = reason
            progress(f"vllm: {target}: not measured in vLLM: {reason}")
            continue
        inputs = {**common, "variant": vmeta.get("input_hash"), "open_loop": ctx.config.section("vllm")["open_loop"],
                  "check": ctx.config.vllm.open_loop_check, "slo": [ctx.config.serving.slo_ttft_ms,
                                                                    ctx.config.serving.slo_tpot_ms]}
        plain_item = ctx.item(f"{target}.json", inputs, is_dir=False)
        plain = plain_item.meta if plain_item.fresh else None
        if plain is None:
            if not eng.fits(f"{target}: the plain engine"):
                continue
            try:
                plain = _measure(eng, target, vdir, acc)
            except EngineStartError as e:  # a target vLLM does not start with: its pairs stay on specq's engine
                skipped[target] = str(e)
                progress(f"vllm: {target}: not measured in vLLM: {e}")
                continue
            plain_item.write_json(plain)
        plains[target] = (vdir, inputs, plain_item, plain)

    # 2. The pairs, k-major: every pair at k = 1 before any at k = 2, so a stage the budget stops
    # still has each pair's first k.
    pairs = {}
    for target, (vdir, inputs, plain_item, plain) in plains.items():
        for spec in ctx.config.drafts:
            name = f"{target}__{draft_slug(spec)}"
            base = draft_method(spec, ctx.run_dir)
            if isinstance(base, str):
                skipped[name] = base
                progress(f"vllm: {name}: {base}")
                continue
            if spec == f"self:{target}":
                skipped[name] = "the draft is the target itself"
                continue
            pair_inputs = {**inputs, "draft": spec, "plain": plain_item.input_hash, "k_max": k_max,
                           "confidence": confidence,
                           "draft_variant": (read_json(ctx.run_dir / "variants" / spec[5:] / "meta.json",
                                                       "draft variant meta.json").get("input_hash")
                                             if spec.startswith("self:") else None)}
            pairs[name] = {"target": target, "spec": spec, "base": base, "inputs": pair_inputs, "parts": []}
    for k in range(1, k_max + 1):
        for name, pair in pairs.items():
            if pair.get("stopped") or len(pair["parts"]) != k - 1:
                continue
            target = pair["target"]
            item = ctx.item(f"parts/{name}.k{k}.json", {**pair["inputs"], "k": k}, is_dir=False)
            if item.fresh:
                pair["parts"].append(item.meta)
                continue
            if not eng.fits(f"{name} at k = {k}" + (" and up" if k < k_max else ""), target):
                pair["stopped"] = "budget"
                continue
            try:
                part = _measure(eng, name, plains[target][0], acc, pair["spec"], k, k == k_max)
            except EngineStartError as e:  # e.g. a draft vLLM cannot load: the pair is skipped, said once
                skipped[name] = str(e)
                pair["stopped"] = "error"
                progress(f"vllm: {name}: not measured in vLLM: {e}")
                continue
            item.write_json(part)
            pair["parts"].append(part)

    # 3. Each pair's tables and recommendation from the k it reached, then its open-loop check.
    for name, pair in pairs.items():
        if not pair["parts"] or pair.get("stopped") == "error":
            continue
        target, spec = pair["target"], pair["spec"]
        vdir, _, _, plain = plains[target]
        ks = [p["k"] for p in pair["parts"]]
        item = ctx.item(f"{name}.json", {**pair["inputs"], "k_measured": ks}, is_dir=False)
        if item.fresh:
            measured[name], recs[name] = item.path.name, item.meta.get("recommendation", {}).get("verdict")
            continue
        doc = {"variant": target, "draft": spec, "draft_slug": draft_slug(spec), "target_dir": str(vdir),
               "engine": info, "speculative_method": pair["base"], "k_values": ks,
               "k_not_measured": [k for k in range(1, k_max + 1) if k not in ks],
               "temperatures": [temp_key(t) for t in s.temperatures], "concurrency": s.concurrency,
               "workload": common["workload"], "by_k": {}}
        for part in pair["parts"]:
            k = part["k"]
            doc["by_k"][str(k)] = _summarize_k(part, plain, confidence)
            b = doc["by_k"][str(k)]["summary"]["all"]
            progress(f"vllm: {name} k={k}: " + "; ".join(
                f"T={t}: {blk['expected_tokens_per_step']:.2f} tokens/step" for t, blk in b.items()))
        tables = engine_tables(plain, doc, confidence, ctx.config.seed)
        doc["tables"] = tables
        doc["recommendation"] = recommend(tables, doc, ctx.run_dir)
        rec = doc["recommendation"]
        if ctx.config.vllm.open_loop_check and rec["speculative_config"] and plain.get("open_loop"):
            n = 1 + bool(rec.get("best_fixed_config") and rec["best_fixed_config"] != rec["speculative_config"])
            if eng.fits(f"{name}: the open-loop check of the recommendation", target, n):
                doc["validation"] = _validate(eng, name, vdir, plain, rec, tables, confidence)
            else:
                doc["validation_skipped"] = "budget"
        item.write_json(doc)
        measured[name], recs[name] = item.path.name, rec["verdict"]
        progress(f"vllm: {name}: {rec['verdict']}")
    ctx.meta.update(measured=measured, skipped=skipped, recommendations=recs, engines=eng.started,
                    budget=budget.to_json())
