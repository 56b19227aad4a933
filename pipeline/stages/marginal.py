"""The marginal-cost stage: which draft length k pays, from measured acceptance and measured time.

    python -m pipeline marginal --run runs/smollm2-135m --config configs/default.yaml

For every (target variant, draft) pair: the marginal-cost table and recommended k
(pipeline/serving/marginal.py); writes `marginal/<pair>.json`, `.md` and `.png`. Timing CIs use
noise pooled over each timing loop (serving/timing_noise.py). A screened pair gets k = 0 with the
screen's record; a pair measured in vLLM is reported from vLLM's own figures, k per concurrency
included (pipeline/serving/served_k.py). Method: docs/methods/marginal.md.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.stage import (StageContext, StageError, atomic_write_bytes, atomic_write_text, progress, read_json,
                                 sha256_file)
from pipeline.report.marginal import render_markdown, write_plot
from pipeline.report.served import render_served, served_plot
from pipeline.serving.marginal import pair_report
from pipeline.serving.served_k import served_report
from pipeline.serving.timing_noise import noise_for, noise_line, pooled_noise
from pipeline.stages.targets import vllm_measured


NO_BATCH_NOTE = "timed at B = 1 in specq's engine; k per batch size is measured in vLLM (the vllm stage)"


def _pair_files(d: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(d.glob("*__*.json"))}


def _k_by_category(report: dict) -> dict | None:
    """{category: {temperature: k}} from a marginal JSON (None for a pair with no table: screened, not timed)."""
    cats = report.get("recommended_k_by_category")
    return None if cats is None else {c: {t: e["k"] for t, e in temps.items()} for c, temps in cats.items()}


def _served(ctx: StageContext, pair: str, path: Path, acc_path: Path | None, confidence: float) -> dict:
    plain_path = path.parent / f"{pair.split('__')[0]}.json"
    item = ctx.item(f"{pair}.json", {"vllm": sha256_file(path), "acceptance": sha256_file(acc_path) if acc_path else None,
                                      "plain": sha256_file(plain_path) if plain_path.is_file() else None,
                                      "confidence": confidence}, is_dir=False)
    if item.fresh:
        return item.meta
    acc = read_json(acc_path, "acceptance artifact") if acc_path else None
    pair_doc = read_json(path, "vllm pair result")
    plain = read_json(plain_path, "vllm plain result") if plain_path.is_file() else None
    report = served_report(pair_doc, acc, confidence, plain)
    atomic_write_bytes(ctx.out_dir / f"{pair}.png", served_plot(report, ctx.config.report.dpi))
    atomic_write_text(ctx.out_dir / f"{pair}.md", render_served(report))
    item.write_json(report)
    for line in report["derived_vs_engine_flagged"]:
        progress(f"marginal: {pair}: derived and vLLM-measured E(k) disagree beyond the CI at {line}")
    progress(f"marginal: {pair} (vLLM): {report['verdict']}")
    return report


def run(ctx: StageContext) -> None:
    acc_files = _pair_files(ctx.run_dir / "acceptance")
    lat_files = _pair_files(ctx.run_dir / "latency")
    served = vllm_measured(ctx.run_dir)
    if not acc_files and not served:
        raise StageError(f"marginal: no acceptance/<variant>__<draft>.json in {ctx.run_dir}")
    missing = sorted(set(acc_files) - set(lat_files) - set(served))
    if missing:
        raise StageError(f"marginal: no latency/{missing[0]}.json for acceptance pair {missing[0]} "
                         "(re-run make latency)")
    confidence = ctx.config.confidence
    # Read once: the run's timing noise pools over every pair's latency document.
    lat_docs = {p: read_json(f, "latency artifact") for p, f in lat_files.items() if p not in served}
    noise = pooled_noise(lat_docs)
    progress("marginal: " + noise_line(noise_for(noise)))
    recommended, by_batch, by_category, engines = {}, {}, {}, {}
    for pair, path in served.items():
        report = _served(ctx, pair, path, acc_files.get(pair), confidence)
        recommended[pair], by_batch[pair], engines[pair] = report["recommended_k"], report["recommended_k_by_batch"], "vllm"
    for pair, acc_path in acc_files.items():
        if pair in served:
            continue
        engines[pair] = "specq"
        item = ctx.item(f"{pair}.json", {"acceptance": sha256_file(acc_path),
                                          "latency": sha256_file(lat_files[pair]),
                                          "confidence": confidence, "timing_noise": noise}, is_dir=False)
        report = item.meta if item.fresh else _specq(ctx, item, pair, read_json(acc_path, "acceptance artifact"),
                                                     lat_docs[pair], noise_for(noise, pair))
        recommended[pair], by_batch[pair] = report.get("recommended_k"), report.get("recommended_k_by_batch")
        by_category[pair] = _k_by_category(report)
    ctx.meta.update(timing_noise=noise, recommended_k=recommended, recommended_k_by_batch=by_batch,
                    recommended_k_by_category=by_category, engine=engines)


def _specq(ctx: StageContext, item, pair: str, acc: dict, latency: dict, noise: dict | None) -> dict:
    """A pair timed by specq's engine (or screened, or not timed): its report, page and plot."""
    report = pair_report(acc, latency, ctx.config.confidence, noise)
    if report.get("not_timed"):  # the latency stage's budget ran out before this pair
        atomic_write_text(ctx.out_dir / f"{pair}.md", f"# {pair}\n\nNot timed: {report['not_timed']}. "
                          "Its acceptance was measured; a re-run with a larger budget.minutes times it.\n")
        item.write_json(report)
        progress(f"marginal: {pair}: not timed ({report['not_timed']})")
        return report
    report.update(recommended_k_by_batch=None, speculative_config_by_batch=None, by_batch_note=NO_BATCH_NOTE)
    # The .md and .png first, the JSON last: the JSON is what marks the pair finished.
    write_plot(report, ctx.out_dir / f"{pair}.png")
    atomic_write_text(ctx.out_dir / f"{pair}.md", render_markdown(report, f"{pair}.png"))
    item.write_json(report)
    if report.get("screened"):
        progress(f"marginal: {pair}: {report['screened_note']}: recommended k = 0")
    progress(f"marginal: {pair}: recommended k = {report['recommended_k']}, by category {_k_by_category(report)}")
    return report
