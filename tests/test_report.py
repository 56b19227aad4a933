"""The report stage on a synthetic run (contract-shaped artifacts in a tmp dir): what it contains,
that the HTML is self-contained, that missing optional inputs become a line and corrupt ones an
error, and (when Chromium is installed) that the HTML renders to a non-blank screenshot."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_gate import make_fake_run

from pipeline.__main__ import main
from pipeline.core.stage import SCHEMA_VERSION

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _median(x: float, spread: float = 0.05) -> dict:
    return {"median": x, "ci": [x * (1 - spread), x * (1 + spread)], "samples": [x * 0.97, x, x * 1.03]}


def add_speed_artifacts(run: Path, variants=("bf16", "good"), latency: bool = True) -> None:
    """Acceptance per position, latency (plain grid and per pair), marginal, variants' and the
    model's meta.json, and the upstream stage meta.json files, to the contract's keys."""
    for stage in ("marginal", "latency", "gate"):
        (run / stage).mkdir(parents=True, exist_ok=True)
    (run / "model").mkdir(exist_ok=True)
    (run / "model" / "meta.json").write_text(json.dumps(
        {"stage": "prepare", "scheme": "reference", "source": {"kind": "test", "model": "tiny"},
         "layers": 4, "hidden_size": 64}))
    for name in variants:
        (run / "variants" / name).mkdir(parents=True, exist_ok=True)
        (run / "variants" / name / "meta.json").write_text(json.dumps(
            {"scheme": "none", "bits": 16, "group_size": None, "library": "torch", "library_version": "x",
             "bytes_on_disk": 3 << 20, "bytes_in_memory": 4 << 20, "quantize_seconds": 1.5,
             "perplexity": 12.3, "reference_perplexity": 12.1, "release": name != "bf16",
             "dtype_compute": "float32", "device_fallback": None}))
        pair = f"{name}__ngram"
        acc_path = run / "acceptance" / f"{pair}.json"
        acc = json.loads(acc_path.read_text())
        rates = np.array([0.8, 0.6, 0.5])
        acc["slices"] = {s: {t: {
            "per_position": [{"position": i + 1, "conditional": float(rates[i]) - 0.1 * float(t),
                              "prefix": float(np.prod(rates[: i + 1])), "expected_beta": float(rates[i]) - 0.05,
                              "n": 40, "ci": [float(rates[i]) - 0.15, float(rates[i]) + 0.1]} for i in range(3)],
            "expected_tokens_per_round": {str(k): 1 + float(np.cumprod(rates)[:k].sum()) for k in (1, 2, 3)},
            "histogram": [8, 10, 12, 10], "rounds": 40, "tokens": 100}
            for t in ("0.0", "0.7")} for s in ("all", "reasoning")}
        # A position no round reached: the engine writes n = 0 with null rates and CI.
        acc["slices"]["reasoning"]["0.0"]["per_position"][2].update(conditional=None, ci=None,
                                                                    expected_beta=None, n=0)
        acc["slices"]["all"]["0.7"]["per_position"][2].update(conditional=None, ci=None,
                                                              expected_beta=None, n=0)
        acc_path.write_text(json.dumps(acc))
        rows = [{"k": k, "tokens_per_round": 1 + 0.6 * k, "round_ms": 10 + 4 * k, "ms_per_token": (10 + 4 * k) / (1 + 0.6 * k),
                 "ms_per_token_ci": [(9 + 4 * k) / (1 + 0.6 * k), (11 + 4 * k) / (1 + 0.6 * k)],
                 "speedup": 10 / ((10 + 4 * k) / (1 + 0.6 * k)), "speedup_ci": [1.0, 1.3],
                 "marginal_ms_per_token": 6.0} for k in (1, 2, 3)]
        (run / "marginal" / f"{pair}.json").write_text(json.dumps(
            {"variant": name, "draft": "ngram", "baseline_ms_per_token": 10.0, "baseline_ci": [9.5, 10.5],
             "rows": rows, "recommended_k": 2}))
        if latency:
            (run / "latency" / f"{name}.json").write_text(json.dumps(
                {"variant": name, "device": "cpu", "bandwidth_gbps": 12.0, "weight_bytes": 3 << 20,
                 "grid": [{"batch": b, "context": c, "ttft_ms": _median(30.0 * b), "tpot_ms": _median(10.0 * b),
                           "peak_memory_bytes": 5 << 20, "bytes_per_step": 3 << 20, "achieved_gbps": 0.3,
                           "roofline_fraction": 0.025} for b in (1, 4) for c in (128, 1024)]}))
            (run / "latency" / f"{pair}.json").write_text(json.dumps(
                {"variant": name, "draft": "ngram", "plain_ms_per_token": _median(10.0),
                 "rows": [{"k": r["k"], "ms_per_token": _median(r["ms_per_token"]), "round_ms": _median(r["round_ms"]),
                           "tokens_per_round": r["tokens_per_round"], "speedup": _median(r["speedup"])} for r in rows]}))
    for stage in ("marginal", "latency"):
        (run / stage / "meta.json").write_text(json.dumps({"stage": stage, "schema": SCHEMA_VERSION, "input_hash": stage}))


def report(tmp_path, latency=True, **kw):
    run, config = make_fake_run(tmp_path, gate_yaml="report: {dpi: 60}\n", **kw)
    add_speed_artifacts(run, ("bf16", *(kw.get("variants") or {"good": {}})), latency=latency)
    assert main(["gate", "--stage-only", "--run", str(run), "--config", str(config)]) == 0
    rc = main(["report", "--run", str(run), "--config", str(config)])
    return rc, run


def test_report_contents_and_self_contained_html(tmp_path):
    rc, run = report(tmp_path, variants={"good": {"flip": 0.02},
                                         "broken": {"damage": {"reasoning": 0.4}}})
    assert rc == 0
    out = run / "report"
    md = (out / "report.md").read_text()
    page = (out / "index.html").read_text()
    assert "## Decision: NO-GO" in md
    for want in ("forest.png", "acceptance-good__ngram.png", "speed-good__ngram.png"):
        assert (out / want).stat().st_size > 1000 and f"]({want})" in md
    # Self-contained: every image is inline, nothing is fetched from disk or network.
    assert page.count("src='data:image/png;base64,") == 1 + 2 * 3
    assert "src='http" not in page and "href=" not in page and "<link" not in page
    # Colour-coded cells for each status and the decision banner.
    assert "class='fail'" in page and "class='pass'" in page and "class='banner no-go'" in page
    for text in ("recommended k", "roofline fraction", "Library versions", "Resolved config",
                 "language/fr", "good__ngram", "TPOT ms"):
        assert text in md, text
    assert "| broken | yes | NO-GO |" in md
    # The page opens with the summary's two tables, and no raw Markdown backticks show.
    first = page[page.index("<h2>Summary</h2>"):page.index("<h2>Decision")]
    assert first.count("<table>") >= 1 and "<th>the cell that decided it</th>" in first
    text = re.sub(r"<pre[^>]*>.*?</pre>", "", page, flags=re.S)
    assert "`" not in re.sub(r"<[^>]+>", "", text) and "<code>bf16</code>" in page


def test_missing_latency_is_a_line_not_a_crash(tmp_path):
    rc, run = report(tmp_path, latency=False)
    assert rc == 0
    md = (run / "report" / "report.md").read_text()
    assert "No plain-decode latency grid in this run" in md
    assert (run / "report" / "speed-good__ngram.png").exists()  # drawn from the marginal JSON


def test_corrupt_marginal_is_an_error(tmp_path, capsys):
    run, config = make_fake_run(tmp_path)
    add_speed_artifacts(run)
    (run / "marginal" / "good__ngram.json").write_text("{oops")
    assert main(["gate", "--stage-only", "--run", str(run), "--config", str(config)]) == 0
    assert main(["report", "--run", str(run), "--config", str(config)]) == 2
    assert "corrupt marginal report" in capsys.readouterr().err
    assert not (run / "report" / "index.html").exists()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install -y chromium)")
def test_the_first_screen_tool_writes_what_a_browser_shows(tmp_path):
    """make report-screenshot: the first 1280 x 1000 of the page, the summary's tables on it."""
    from PIL import Image

    from pipeline.tools.screenshot import main as shoot

    rc, run = report(tmp_path)
    assert rc == 0 and shoot(["--run", str(run)]) == 0
    img = Image.open(run / "report" / "first-screen.png")
    assert img.size == (1280, 1000)
    ink = np.asarray(img.convert("L"), dtype=float) < 200
    assert ink.mean() > 0.02  # text and tables, not a blank page


def test_the_first_screen_tool_without_a_page_is_one_line(tmp_path, capsys):
    from pipeline.tools.screenshot import main as shoot

    assert shoot(["--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specq: ")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install -y chromium)")
def test_html_renders_in_headless_chromium(tmp_path):
    rc, run = report(tmp_path)
    assert rc == 0
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
                    "--window-size=1280,2400", f"--screenshot={shot}",
                    (run / "report" / "index.html").resolve().as_uri()],
                   check=True, timeout=120, capture_output=True)
    from PIL import Image

    img = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert img.shape[0] >= 2000 and img.shape[1] >= 1200
    # Not blank: text, tables and figures make the page far from uniform white.
    assert (img < 200).mean() > 0.02, (img < 200).mean()


def test_one_number_format_everywhere():
    """pipeline/report/format.py: a missing number (None, NaN, inf) is "-", an absent interval is
    "", digits are the caller's, a value that is not a number is written as it is."""
    from pipeline.report.format import interval, median_ci, nbytes, number

    assert [number(x, 3) for x in (None, float("nan"), float("inf"), 0.12345, 2, "n/a")] == \
        ["-", "-", "-", "0.123", "2.000", "n/a"]
    assert number(-0.02, 3, signed=True) == "-0.020" and number(0.0, 2, signed=True) == "+0.00"
    assert interval(None, 2) == "" and interval([], 2) == "" and interval([None, None], 3) == "[-, -]"
    assert interval([0.1, 0.25], 2) == "[0.10, 0.25]"
    assert interval([-0.05, 0.012], 3, signed=True) == "[-0.050, +0.012]"
    assert median_ci({"median": 10, "ci": [9, 11]}, 2) == "10.00 [9.00, 11.00]" and median_ci(None, 2) == "-"
    assert nbytes(3 << 20) == "3.0 MiB" and nbytes(6e10, "GB", 2) == "60.00 GB" and nbytes(None) == "-"
