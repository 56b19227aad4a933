"""The marginal-cost stage: which draft length k pays, from measured acceptance and measured time.

    python -m pipeline marginal --run runs/smollm2-135m --config configs/default.yaml

For every (target variant, draft) pair: the marginal-cost table and recommended k
(pipeline/serving/marginal.py), and where the pair was timed under batching, k per batch size, the
vLLM table and the serving simulation (pipeline/serving/batching.py); writes `marginal/<pair>.json`,
`.md` and `.png`. Timing CIs use noise pooled over each timing loop (serving/timing_noise.py). A
screened pair gets k = 0 with the screen's record; a pair measured in vLLM is reported from vLLM's
own figures (pipeline/serving/served_k.py). Method: docs/methods/batching.md.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.core.stage import (StageContext, StageError, atomic_write_bytes, atomic_write_text, progress, read_json,
                                 sha256_file)
from pipeline.report.batching import batch_markdown, screened_batch_markdown, serving_plot, speedup_plot
from pipeline.report.marginal import write_markdown, write_plot
from pipeline.report.served import render_served, served_plot
from pipeline.serving.batching import batching_report, screened_batching
from pipeline.serving.lengths import request_lengths
from pipeline.serving.marginal import pair_report
from pipeline.serving.served_k import served_report
from pipeline.serving.timing_noise import noise_for, noise_line, pooled_noise


def _pair_files(d: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(d.glob("*__*.json"))}


def _batching_paths(run_dir: Path, pair: str) -> tuple[Path, Path]:
    """The pair's batched cells and closed loop, and its target's plain latency grid."""
    return run_dir / "latency" / "batched" / f"{pair}.json", run_dir / "latency" / f"{pair.split('__')[0]}.json"


def _batching_inputs(run_dir: Path, pair: str, config) -> dict:
    """What the marginal item for `pair` additionally depends on."""
    batched, grid = _batching_paths(run_dir, pair)
    return {"batched": sha256_file(batched) if batched.is_file() else None,
            "grid": sha256_file(grid) if grid.is_file() else None, "serving": config.section("serving")}


def _latency_docs(run_dir: Path, lat_files: dict[str, Path]) -> tuple[dict[str, dict], dict[str, dict]]:
    """Every pair's latency document and, where it has one, its batched one, read once: the run's
    timing noise pools over all of them (timing_noise.py), and each pair's report reads its own."""
    batched = {pair: read_json(path, "batched latency") for pair in lat_files
               for path in [_batching_paths(run_dir, pair)[0]] if path.is_file()}
    return {pair: read_json(path, "latency artifact") for pair, path in lat_files.items()}, batched


def _add_batching(ctx: StageContext, pair: str, report: dict, acceptance: dict, batched: dict | None,
                  noise: dict | None) -> str:
    """Add the batching keys to `report` and write its two figures; returns the Markdown section.
    batched: the pair's latency/batched document (None: it has none)."""
    batched_path, grid_path = _batching_paths(ctx.run_dir, pair)
    if batched is None or not grid_path.is_file():
        report["recommended_k_by_batch"] = None
        report["speculative_config_by_batch"] = None
        report["by_batch_note"] = f"no {batched_path.relative_to(ctx.run_dir)} (re-run make latency)"
        return ""
    if isinstance(batched, dict) and batched.get("screened"):  # not timed under batching: k = 0 at every B
        report.update(screened_batching(batched))
        return screened_batch_markdown(report)
    p = report["primary"]
    acc_slice = acceptance["slices"][p["slice"]][p["temperature"]]
    lengths = request_lengths(acceptance, p["slice"], p["temperature"])
    if lengths["lengths"] == "fixed":
        progress(f"marginal: {pair}: serving simulation at fixed lengths ({lengths['source']})")
    report.update(batching_report(report, acc_slice, batched,
                                  read_json(grid_path, "latency grid"), ctx.config.serving, report["confidence"],
                                  ctx.config.seed, lengths, noise_for(noise, f"{pair} batched")))
    dpi = ctx.config.report.dpi
    atomic_write_bytes(ctx.out_dir / f"{pair}.batch.png", speedup_plot(report, dpi))
    atomic_write_bytes(ctx.out_dir / f"{pair}.serving.png", serving_plot(report, dpi))
    return batch_markdown(report, f"{pair}.batch.png", f"{pair}.serving.png")


def _k_by_category(report: dict) -> dict | None:
    """{category: {temperature: k}} from a marginal JSON (None for one made before categories)."""
    cats = report.get("recommended_k_by_category")
    return None if cats is None else {c: {t: e["k"] for t, e in temps.items()} for c, temps in cats.items()}


def _served_pairs(run_dir: Path) -> dict[str, Path]:
    """The pairs the vllm stage measured (its meta.json names them)."""
    meta = run_dir / "vllm" / "meta.json"
    if not meta.is_file():
        return {}
    measured = read_json(meta, "vllm meta.json").get("measured") or {}
    return {pair: run_dir / "vllm" / f"{pair}.json" for pair in measured}


def _served(ctx: StageContext, pair: str, path: Path, acc_path: Path | None, confidence: float) -> dict:
    plain_path = path.parent / f"{pair.split('__')[0]}.json"
    item = ctx.item(f"{pair}.json", {"vllm": sha256_file(path), "acceptance": sha256_file(acc_path) if acc_path else None,
                                      "plain": sha256_file(plain_path) if plain_path.is_file() else None,
                                      "confidence": confidence}, is_dir=False)
    if item.fresh:
        return item.meta
    acc = read_json(acc_path, "acceptance artifact") if acc_path else None
    pair_doc = read_json(path, "vllm pair result")
    plain_path = path.parent / f"{pair_doc['variant']}.json"
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
    served = _served_pairs(ctx.run_dir)
    if not acc_files and not served:
        raise StageError(f"marginal: no acceptance/<variant>__<draft>.json in {ctx.run_dir}")
    missing = sorted(set(acc_files) - set(lat_files) - set(served))
    if missing:
        raise StageError(f"marginal: no latency/{missing[0]}.json for acceptance pair {missing[0]} "
                         "(re-run make latency)")
    confidence = ctx.config.confidence
    lat_docs, batched_docs = _latency_docs(ctx.run_dir, {p: f for p, f in lat_files.items() if p not in served})
    noise = pooled_noise(lat_docs, batched_docs)
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
                                          "confidence": confidence, "timing_noise": noise,
                                          **_batching_inputs(ctx.run_dir, pair, ctx.config)}, is_dir=False)
        if item.fresh:
            recommended[pair] = item.meta.get("recommended_k")
            by_batch[pair] = item.meta.get("recommended_k_by_batch")
            by_category[pair] = _k_by_category(item.meta)
            continue
        acc = read_json(acc_path, "acceptance artifact")
        report = pair_report(acc, lat_docs[pair], confidence, noise_for(noise, pair))
        if report.get("not_timed"):  # the latency stage's budget ran out before this pair
            atomic_write_text(ctx.out_dir / f"{pair}.md", f"# {pair}\n\nNot timed: {report['not_timed']}. "
                              "Its acceptance was measured; a re-run with a larger budget.minutes times it.\n")
            item.write_json(report)
            recommended[pair], by_batch[pair], by_category[pair] = None, None, None
            progress(f"marginal: {pair}: not timed ({report['not_timed']})")
            continue
        extra = _add_batching(ctx, pair, report, acc, batched_docs.get(pair), noise)
        # The .md and .png first, the JSON last: the JSON is what marks the pair finished.
        write_plot(report, ctx.out_dir / f"{pair}.png")
        write_markdown(report, ctx.out_dir / f"{pair}.md", f"{pair}.png", extra)
        item.write_json(report)
        recommended[pair] = report["recommended_k"]
        by_batch[pair] = report.get("recommended_k_by_batch")
        by_category[pair] = _k_by_category(report)
        if report.get("screened"):
            progress(f"marginal: {pair}: {report['screened_note']}: recommended k = 0")
        progress(f"marginal: {pair}: recommended k = {report['recommended_k']}, by batch size "
                 f"{report.get('recommended_k_by_batch')}, by category {by_category[pair]}")
        if report.get("workload_note"):
            progress(f"marginal: {pair}: {report['workload_note']}")
    ctx.meta["timing_noise"] = noise
    ctx.meta["recommended_k"] = recommended
    ctx.meta["recommended_k_by_batch"] = by_batch
    ctx.meta["recommended_k_by_category"] = by_category
    ctx.meta["engine"] = engines
