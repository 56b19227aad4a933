"""The gate stage on synthetic artifacts (written to the contract in tmp dirs): decisions, the
multiplicity families, clustering by prompt, bad input, and `gate-check`'s exit status (0 go,
1 no-go, 3 inconclusive, 2 bad input) through pipeline.__main__.main."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.__main__ import main
from pipeline.gate.decision import decide, overall_decision
from pipeline.core.stage import SCHEMA_VERSION, StageError

SLICES = ("reasoning", "language", "calibration", "long_context")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_fake_run(root: Path, variants: dict[str, dict] | None = None, n: int = 1000,
                  gate_yaml: str = "", lossless_ok: bool = True, seed: int = 0) -> tuple[Path, Path]:
    """A run dir with quality and acceptance results for a reference `bf16`
    and the given variants: name -> {"release": bool, "damage": {slice: fraction of the
    reference's correct items the variant gets wrong}, "flip": fraction flipped either way}.
    Variants draw their noise in order, so appending a variant leaves the earlier ones' data
    as they were. Returns (run_dir, config path)."""
    variants = variants if variants is not None else {"good": {"release": True, "flip": 0.02}}
    rng = np.random.default_rng(seed)
    run = root / "run"
    # Reference items: binary scores; long_context items come 5 to a haystack (n/5 clusters), the
    # other slices' items are distinct (their own clusters); language items carry a group;
    # calibration items carry option probabilities.
    ref_rows = {}
    for s in SLICES:
        rows = []
        for i in range(n):
            probs = rng.dirichlet([2, 1, 1, 1]).tolist()
            label = int(np.argmax(probs)) if rng.random() < 0.7 else int(rng.integers(4))
            score = float(label == int(np.argmax(probs))) if s == "calibration" else float(rng.random() < 0.7)
            cluster = f"hay-{i // 5}" if s == "long_context" else None
            row = {"id": f"{s}-{i}", "cluster": cluster,
                   "slice": s, "group": ["fr", "de", "es", "zh"][i % 4] if s == "language" else None,
                   "metric": "accuracy", "score": score, "scores": {"accuracy": score},
                   "prediction": "x", "target": "x"}
            if s == "calibration":
                row.update(option_probs=probs, label=label)
            rows.append(row)
        ref_rows[s] = rows
        _write_jsonl(run / "quality" / "bf16" / f"{s}.jsonl", rows)
    for name, spec in variants.items():
        for s in SLICES:
            rows = []
            for r in ref_rows[s]:
                r = dict(r)
                if rng.random() < spec.get("flip", 0.0):
                    r["score"] = 1.0 - r["score"]
                if r["score"] == 1.0 and rng.random() < spec.get("damage", {}).get(s, 0.0):
                    r["score"] = 0.0
                    if "option_probs" in r:  # the damaged model now prefers a wrong option
                        wrong = (r["label"] + 1) % 4
                        r["option_probs"] = [0.7 if j == wrong else 0.1 for j in range(4)]
                rows.append(r)
            _write_jsonl(run / "quality" / name / f"{s}.jsonl", rows)
        (run / "quality" / f"{name}.json").write_text(json.dumps({
            "variant": name, "slices": {}, "distribution": {
                "kl_mean": 0.01, "kl_ci": [0.008, 0.012], "top1_agreement": 0.97,
                "top1_ci": [0.95, 0.99], "ppl_ratio": 1.01, "ppl_ratio_ci": [1.0, 1.02], "n_docs": 4}}))
    for name in ("bf16", *variants):
        ok = lossless_ok or name != "bf16"
        pair = {"variant": name, "draft": "ngram", "k_max": 3, "slices": {},
                "lossless": {"greedy_identical": ok, "greedy_lossless": ok, "prompts": 4,
                             "mismatches": [] if ok else [{"prompt": 0}], "unexplained": 0 if ok else 1,
                             "sampling": {"test": "chi2", "p_value": 0.4, "alpha": 0.01, "pass": True}}}
        (run / "acceptance").mkdir(parents=True, exist_ok=True)
        (run / "acceptance" / f"{name}__ngram.json").write_text(json.dumps(pair))
    for stage in ("quality", "acceptance"):
        (run / stage / "meta.json").write_text(json.dumps({"stage": stage, "schema": SCHEMA_VERSION, "input_hash": stage}))
    lines = ["quantize:", "  reference: bf16", "  variants:", "    bf16: {scheme: none, release: false}"]
    for name, spec in variants.items():
        lines.append(f"    {name}: {{scheme: none, release: {str(spec.get('release', True)).lower()}}}")
    config = root / "config.yaml"
    config.write_text("\n".join(lines) + "\n" + gate_yaml)
    return run, config


def gate(run: Path, config: Path, force: bool = False) -> tuple[int, int, dict | None]:
    """Run the gate stage, then gate-check; returns (stage rc, check rc, gate.json)."""
    rc = main(["gate", "--stage-only", "--run", str(run), "--config", str(config)] + (["--force"] if force else []))
    check = main(["gate-check", "--run", str(run), "--config", str(config)]) if rc == 0 else None
    path = run / "gate.json"
    return rc, check, json.loads(path.read_text()) if path.exists() else None


def test_good_variant_is_go_and_exit_code_zero(tmp_path, capsys):
    run, config = make_fake_run(tmp_path)
    rc, check, g = gate(run, config)
    assert (rc, check) == (0, 0)
    assert g["decision"] == "go" and g["variants"]["good"]["decision"] == "go"
    cells = g["variants"]["good"]["slices"]
    assert set(cells) == {*SLICES, "calibration:brier"}  # ECE is reported, not gated
    for key, c in cells.items():
        assert c["status"] == "pass", (key, c)
        assert c["ci"][0] > -c["margin"] and c["n"] == 1000
    assert cells["long_context"]["n_clusters"] == 200 and cells["long_context"]["design_effect"] == 5.0
    assert cells["long_context"]["method"].startswith("tango score, 200 clusters")
    assert cells["reasoning"]["method"] == "tango score" and cells["reasoning"]["design_effect"] == 1.0
    assert cells["calibration:brier"]["method"] == "paired-t"
    ece = cells["calibration"]["calibration_error"]
    assert ece["gated"] is False and set(ece["ece_debiased"]) == {"reference", "variant", "diff"}
    assert set(cells["language"]["groups"]) == {"fr", "de", "es", "zh"}
    assert not cells["language"]["groups"]["fr"]["gated"]
    out = capsys.readouterr().out
    assert "specq gate: GO" in out and "| good |" in out and "calibration:ece_debiased" in out
    assert (run / "gate" / "table.md").read_text().startswith("# specq gate: GO")


def test_identical_copy_is_go_with_enough_items(tmp_path):
    # No item differs: Tango's bound at 0 of n discordant items (the haystacks' design effect of
    # 5 makes long_context count as 80 items): 400 items put it above the 5-point margin.
    run, config = make_fake_run(tmp_path, {"copy": {"release": True}}, n=400)
    rc, check, g = gate(run, config)
    assert (rc, check) == (0, 0)
    for c in g["variants"]["copy"]["slices"].values():
        assert c["diff"] == 0.0 and c["se"] == 0.0 and c["status"] == "pass"
        assert -c["margin"] < c["ci"][0] < 0.0 < c["ci"][1]


def test_identical_copy_at_small_n_is_inconclusive_never_no_go(tmp_path, capsys):
    # 40 items that all agree cannot rule out a 5-point regression (up to ~9% of items could
    # differ): the cell says so, and how many agreeing items would settle it; gate-check exits 3
    # and the headline says INCONCLUSIVE, not NO-GO.
    run, config = make_fake_run(tmp_path, {"copy": {"release": True}}, n=40)
    rc, check, g = gate(run, config)
    assert (rc, check) == (0, 3)
    assert g["decision"] == "inconclusive" and g["variants"]["copy"]["decision"] == "inconclusive"
    for c in g["variants"]["copy"]["slices"].values():
        assert c["diff"] == 0.0 and c["status"] == "inconclusive"
        assert c["ci"][0] < -c["margin"] and c["items_to_settle"] > 40
    out = capsys.readouterr().out
    assert out.startswith("# specq gate: INCONCLUSIVE") and "NO-GO" not in out
    assert "items per slice would settle it" in out


def test_damaged_variant_is_no_go_on_the_damaged_slices(tmp_path):
    run, config = make_fake_run(tmp_path, {
        "good": {"release": True, "flip": 0.02},
        "broken": {"release": True, "flip": 0.02, "damage": {"reasoning": 0.4, "calibration": 0.5}},
    })
    rc, check, g = gate(run, config)
    assert (rc, check) == (0, 1)
    assert g["decision"] == "no-go"
    broken = g["variants"]["broken"]
    assert broken["decision"] == "no-go"
    assert broken["slices"]["reasoning"]["status"] == "fail"
    assert broken["slices"]["calibration"]["status"] == "fail"
    assert broken["slices"]["calibration:brier"]["status"] == "fail"
    assert broken["slices"]["calibration"]["calibration_error"]["ece_debiased"]["diff"] < 0
    assert broken["slices"]["language"]["status"] == "pass"
    assert g["variants"]["good"]["decision"] == "go"


def test_non_release_failure_does_not_block(tmp_path):
    run, config = make_fake_run(tmp_path, {
        "good": {"release": True, "flip": 0.02},
        "experiment": {"release": False, "damage": {"reasoning": 0.5}},
    })
    rc, check, g = gate(run, config)
    assert (rc, check) == (0, 0)
    assert g["variants"]["experiment"]["decision"] == "no-go" and g["decision"] == "go"


def _verdict(g: dict, name: str) -> dict:
    v = g["variants"][name]
    return {"decision": v["decision"], **{k: (c["status"], c["ci"], c["alpha_lower"], c["alpha_upper"])
                                         for k, c in v["slices"].items()}}


@pytest.mark.parametrize("sibling", [{"release": False, "damage": {"reasoning": 0.6, "language": 0.6}},
                                     {"release": True, "flip": 0.02}])
def test_a_sibling_never_changes_a_variants_verdict(tmp_path, sibling):
    """Same data for `good` with and without a sibling (a broken release: false experiment, or
    another release variant): its cells, their levels and its decision are identical. Under the
    old single Holm family over every variant, a broken sibling turned an identical `good` from go
    to inconclusive in 4 of 10 seeds at n = 400."""
    alone = make_fake_run(tmp_path / "alone", {"good": {"release": True, "flip": 0.03}}, n=400, seed=3)
    both = make_fake_run(tmp_path / "both", {"good": {"release": True, "flip": 0.03}, "sib": sibling},
                         n=400, seed=3)
    (_, _, g1), (_, _, g2) = gate(*alone), gate(*both)
    for s in SLICES:  # the same data, drawn before the sibling's
        a = (tmp_path / "alone/run/quality/good" / f"{s}.jsonl").read_text()
        assert a == (tmp_path / "both/run/quality/good" / f"{s}.jsonl").read_text()
    assert _verdict(g1, "good") == _verdict(g2, "good")
    assert g2["families"]["fail"] == {"good": len(SLICES) + 1, "sib": len(SLICES) + 1}
    assert g2["families"]["pass"] == []


def test_choosing_among_release_variants_adjusts_the_pass_side_across_them_only(tmp_path):
    variants = {"a": {"flip": 0.02}, "b": {"flip": 0.02},
                "exp": {"release": False, "damage": {"reasoning": 0.5}}}
    run, config = make_fake_run(tmp_path, variants, gate_yaml="gate: {multiplicity: bonferroni, "
                                                              "select_among_variants: true}\n")
    _, _, g = gate(run, config)
    assert g["families"]["pass"] == ["a", "b"]
    m = len(SLICES) + 1  # each variant's fail family: its slices and its Brier row
    for name in ("a", "b"):
        for c in g["variants"][name]["slices"].values():
            assert c["alpha_lower"] == pytest.approx(0.025 / 2) and c["alpha_upper"] == pytest.approx(0.025 / m)
            assert c["ci_level"] == pytest.approx(1 - c["alpha_lower"] - c["alpha_upper"])
    # The release: false variant is in nobody's pass family and is drawn at alpha.
    assert all(c["alpha_lower"] == pytest.approx(0.025) for c in g["variants"]["exp"]["slices"].values())


def test_the_top_level_confidence_is_the_gates_alpha(tmp_path):
    run, config = make_fake_run(tmp_path, gate_yaml="confidence: 0.9\n")
    rc, _, g = gate(run, config)
    assert rc == 0 and g["confidence"] == 0.9 and "one-sided alpha 0.05 per bound" in g["method"]
    cells = list(g["variants"]["good"]["slices"].values())
    assert cells and all(c["alpha_lower"] == pytest.approx(0.05) for c in cells)  # (1 - 0.9) / 2


def test_holm_on_the_fail_side_within_a_variant(tmp_path):
    run, config = make_fake_run(tmp_path, {"a": {"flip": 0.02}, "b": {"flip": 0.02}})
    _, _, g = gate(run, config)
    m = len(SLICES) + 1
    assert g["family_size"] == m
    for v in g["variants"].values():
        cells = list(v["slices"].values())
        # No cell fails, so Holm's first step already stops: every upper bound at alpha/m.
        assert all(c["alpha_upper"] == pytest.approx(0.025 / m) for c in cells)
        assert all(c["alpha_lower"] == pytest.approx(0.025) for c in cells)  # intersection-union
        assert all(c["p_adjusted"][1] >= c["p_inferior"] for c in cells)


def test_inconclusive_says_how_many_items_would_settle_it(tmp_path, capsys):
    # Few items and real disagreement: the CI straddles -margin.
    run, config = make_fake_run(tmp_path, {"noisy": {"release": True, "flip": 0.15}}, n=40)
    rc, check, g = gate(run, config)
    assert (rc, check) == (0, 3)
    cells = g["variants"]["noisy"]["slices"]
    assert cells["language"]["status"] == "inconclusive"
    assert cells["language"]["items_to_settle"] > 40
    for c in cells.values():
        if c["status"] == "inconclusive":  # only a diff sitting exactly on -margin has no finite n
            assert (c["items_to_settle"] is None) == (c["diff"] == -c["margin"]), c
        else:
            assert c["items_to_settle"] is None
    assert g["variants"]["noisy"]["decision"] == "inconclusive" and g["decision"] == "inconclusive"
    table = capsys.readouterr().out
    assert f"| {cells['language']['items_to_settle']} |" in table


def test_gated_groups_join_the_variants_fail_family(tmp_path):
    run, config = make_fake_run(tmp_path, gate_yaml="gate: {gate_groups: true}\n")
    _, _, g = gate(run, config)
    assert g["families"]["fail"]["good"] == len(SLICES) + 1 + 4
    groups = g["variants"]["good"]["slices"]["language"]["groups"]
    assert all(gc["gated"] for gc in groups.values())


def test_brier_has_its_own_margin(tmp_path):
    run, config = make_fake_run(tmp_path, gate_yaml="gate: {margins: {calibration: 0.3}, brier_margin: 0.07}\n")
    _, _, g = gate(run, config)
    cells = g["variants"]["good"]["slices"]
    assert cells["calibration"]["margin"] == 0.3 and cells["calibration:brier"]["margin"] == 0.07


def test_duplicated_prompts_form_one_cluster(tmp_path):
    """Items that share a prompt are one cluster even when nothing labels them so: from the
    per-item prompt hash lm-eval records. Here 1000 reasoning items come from 145 prompts (the old
    tool_args slice at gpu.yaml size) and 1000 language items from 100; calibration's are distinct."""
    run, config = make_fake_run(tmp_path)
    for name in ("bf16", "good"):
        for s, prompts in (("reasoning", 145), ("language", 100)):
            path = run / "quality" / name / f"{s}.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            _write_jsonl(path, [{**r, "prompt_hash": f"h{i % prompts}"} for i, r in enumerate(rows)])
    _, _, g = gate(run, config)
    cells = g["variants"]["good"]["slices"]
    sizes = np.bincount(np.arange(1000) % 145)
    # The design effect is the largest cluster's size (7; sum n_g^2 / n = 6.91 holds only when
    # every prompt has the same discordance rates).
    assert cells["reasoning"]["n_clusters"] == 145 and cells["reasoning"]["design_effect"] == sizes.max() == 7
    assert cells["language"]["n_clusters"] == 100 and cells["calibration"]["n_clusters"] == 1000


def test_distribution_threshold_is_gated(tmp_path):
    run, config = make_fake_run(tmp_path, gate_yaml="gate: {max_kl: 0.005}\n")
    rc, check, g = gate(run, config)
    assert (rc, check) == (0, 1)
    assert g["variants"]["good"]["distribution"]["checks"]["kl"]["status"] == "fail"
    assert g["variants"]["good"]["decision"] == "no-go"


def test_distribution_threshold_without_a_measurement_is_inconclusive(tmp_path):
    run, config = make_fake_run(tmp_path, gate_yaml="gate: {min_top1_agreement: 0.9}\n")
    summary = run / "quality" / "good.json"
    doc = json.loads(summary.read_text())
    doc["distribution"]["top1_ci"] = None
    summary.write_text(json.dumps(doc))
    rc, check, g = gate(run, config)
    assert (rc, check) == (0, 3)
    assert g["variants"]["good"]["distribution"]["checks"]["top1_agreement"]["status"] == "inconclusive"
    assert g["variants"]["good"]["decision"] == "inconclusive"


def test_lossless_failure_is_a_speculation_no_go(tmp_path, capsys):
    run, config = make_fake_run(tmp_path, lossless_ok=False)
    rc, check, g = gate(run, config)
    assert (rc, check) == (0, 0)  # quality decides the release; speculation is listed apart
    assert g["speculation"]["decision"] == "no-go"
    assert g["speculation"]["pairs"]["bf16__ngram"]["decision"] == "no-go"
    assert g["speculation"]["pairs"]["good__ngram"]["decision"] == "go"
    assert "bf16__ngram | False" in capsys.readouterr().out


def test_missing_quality_for_a_release_variant_is_not_go(tmp_path):
    run, config = make_fake_run(tmp_path)
    config.write_text(config.read_text().replace("    good:", "    extra: {scheme: none}\n    good:"))
    rc, check, g = gate(run, config)
    assert (rc, check) == (0, 3)
    assert g["variants"]["extra"]["decision"] == "inconclusive"
    assert g["variants"]["extra"]["missing"] == ["quality results"]


def test_no_release_variant_is_bad_input(tmp_path, capsys):
    run, config = make_fake_run(tmp_path, {"good": {"release": False, "flip": 0.02}})
    rc, check, g = gate(run, config)
    assert rc == 2 and g is None
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specq:")]
    assert len(err) == 1 and "release: true" in err[0]


def test_different_item_ids_are_an_error(tmp_path, capsys):
    run, config = make_fake_run(tmp_path)
    path = run / "quality" / "good" / "reasoning.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n")
    rc, check, g = gate(run, config)
    assert rc == 2 and g is None
    err = capsys.readouterr().err
    assert "good/reasoning" in err and "different items" in err and len(err.strip().splitlines()) >= 1


def test_corrupt_item_is_an_error(tmp_path, capsys):
    run, config = make_fake_run(tmp_path)
    (run / "quality" / "good" / "language.jsonl").open("a").write("{not json\n")
    rc, _, g = gate(run, config)
    assert rc == 2 and g is None
    assert "language.jsonl:1001" in capsys.readouterr().err


def test_gate_check_exit_status_and_bad_input(tmp_path, capsys):
    assert main(["gate-check", "--run", str(tmp_path), "--config", "configs/smoke.yaml"]) == 2
    assert "missing gate result" in capsys.readouterr().err
    for decision, code in (("go", 0), ("no-go", 1), ("inconclusive", 3), ("maybe", 2)):
        (tmp_path / "gate.json").write_text(json.dumps(
            {"decision": decision, "reference": "bf16", "release_variants": ["v"], "method": "m",
             "variants": {"v": {"decision": decision, "release": True, "slices": {}, "missing": []}}}))
        assert main(["gate-check", "--run", str(tmp_path), "--config", "configs/smoke.yaml"]) == code
        assert main(["gate-check", "--run", str(tmp_path), "--config", "configs/smoke.yaml",
                     "--no-exit-code"]) == (0 if code != 2 else 2)


def test_gate_check_refuses_a_gate_of_another_schema(tmp_path, capsys):
    """gate-check reads gate.json only beside a gate/meta.json of this specq's schema: another
    schema (or none) is one line on stderr and exit 2, not a guess at its keys."""
    (tmp_path / "gate.json").write_text(json.dumps(
        {"decision": "go", "reference": "bf16", "release_variants": ["v"], "method": "m",
         "variants": {"v": {"decision": "go", "release": True, "slices": {}, "missing": []}}}))
    (tmp_path / "gate").mkdir()
    for schema in (None, SCHEMA_VERSION + 1):
        meta = {"stage": "gate", "input_hash": "h"} | ({} if schema is None else {"schema": schema})
        (tmp_path / "gate" / "meta.json").write_text(json.dumps(meta))
        capsys.readouterr()
        assert main(["gate-check", "--run", str(tmp_path), "--config", "configs/smoke.yaml", "--no-exit-code"]) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [f"specq: gate: artifacts from another specq version (schema "
                                    f"{'none' if schema is None else schema}, this is {SCHEMA_VERSION}) in "
                                    f"{tmp_path / 'gate'}: re-run make gate"]
    (tmp_path / "gate" / "meta.json").write_text(json.dumps({"stage": "gate", "schema": SCHEMA_VERSION}))
    assert main(["gate-check", "--run", str(tmp_path), "--config", "configs/smoke.yaml"]) == 0


def test_gate_decides_on_one_variant_when_asked(tmp_path, capsys):
    """`gate --variant V` decides on V's cells only (the run's decision is the worst variant's);
    a name that is not a release variant is bad input, said in one line."""
    from pipeline.stages.gate import gate_check

    variants = {"a": "go", "b": "no-go", "c": "inconclusive"}
    (tmp_path / "gate.json").write_text(json.dumps(
        {"decision": "no-go", "reference": "bf16", "release_variants": list(variants), "method": "m",
         "variants": {v: {"decision": d, "release": True, "slices": {}, "missing": []} for v, d in variants.items()}}))
    assert gate_check(tmp_path, table=False) == 1
    assert [line.split()[:2] for line in capsys.readouterr().out.splitlines()] == [[v, d] for v, d in variants.items()]
    assert gate_check(tmp_path, ["a"], table=False) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "decision for a: go"
    assert gate_check(tmp_path, ["c"], table=False) == 3 and gate_check(tmp_path, ["a", "c"], table=False) == 3
    assert gate_check(tmp_path, ["a", "b"], table=False) == 1
    with pytest.raises(StageError, match=r"^gate --variant z: not a release variant of this run \(release variants: a, b, c\)$"):
        gate_check(tmp_path, ["z"])


def test_decide():
    assert decide(["pass", "pass"]) == "go"
    assert decide(["pass", "inconclusive"]) == "inconclusive"
    assert decide(["inconclusive", "fail", "pass"]) == "no-go"
    assert decide([]) == "inconclusive"
    assert overall_decision(["go", "inconclusive"]) == "inconclusive"
    assert overall_decision(["inconclusive", "no-go"]) == "no-go"
    assert overall_decision(["go", "go"]) == "go"


def test_a_task_the_quality_stage_could_not_score_keeps_every_variant_from_go(tmp_path):
    """Issue 26: a known lm-eval task whose data was unreachable was skipped by quality (one
    line, meta.json's skipped_tasks) and gate.json listed nothing missing, so a good variant came
    out go without that slice. Now the variant is inconclusive and gate.json names the slice and
    why; a requested slice with no results is missing too."""
    run, config = make_fake_run(tmp_path)
    assert gate(run, config)[2]["decision"] == "go"  # every slice scored: go
    meta = run / "quality" / "meta.json"
    meta.write_text(json.dumps({"stage": "quality", "input_hash": "q2", "slices": list(SLICES),
                                "tasks": ["arc_easy"],
                                "skipped_tasks": {"hellaswag": "its data is not reachable (ConnectionError)"}}))
    rc, check, g = gate(run, config, force=True)
    entry = g["variants"]["good"]
    assert (rc, check) == (0, 3) and g["decision"] == "inconclusive" and entry["decision"] == "inconclusive"
    assert entry["missing_slices"] == {
        "hellaswag": "not scored: its data is not reachable (ConnectionError)",
        "arc_easy": "requested, but the reference has no results for it"}
    assert any("hellaswag" in m and "not reachable" in m for m in entry["missing"])
    # Its scored cells are still decided and shown.
    assert all(c["status"] == "pass" for c in entry["slices"].values())


def test_a_fail_is_no_go_even_when_a_task_is_missing(tmp_path):
    """A skipped task makes a variant inconclusive only when nothing it was gated on failed: a
    variant that fails a scored slice is no-go (exit 1), whatever else is missing."""
    run, config = make_fake_run(tmp_path, {"bad": {"release": True, "damage": {"reasoning": 0.3}}})
    meta = run / "quality" / "meta.json"
    meta.write_text(json.dumps({"stage": "quality", "input_hash": "q2", "slices": list(SLICES), "tasks": [],
                                "skipped_tasks": {"hellaswag": "its data is not reachable (ConnectionError)"}}))
    rc, check, g = gate(run, config, force=True)
    entry = g["variants"]["bad"]
    assert entry["slices"]["reasoning"]["status"] == "fail" and "hellaswag" in entry["missing_slices"]
    assert (check, g["decision"], entry["decision"]) == (1, "no-go", "no-go")


def test_a_greedy_check_the_budget_cut_to_nothing_is_unchecked_not_go(tmp_path):
    run, config = make_fake_run(tmp_path)
    path = run / "acceptance" / "good__ngram.json"
    doc = json.loads(path.read_text())
    doc["lossless"].update(greedy_identical=None, greedy_lossless=None, prompts=0, prompts_skipped=8, mismatches=[])
    path.write_text(json.dumps(doc))
    rc, check, g = gate(run, config)
    pair = g["speculation"]["pairs"]["good__ngram"]
    assert pair["decision"] == "unchecked" and "budget" in pair["why"]
    assert g["speculation"]["decision"] == "unchecked"
    assert g["speculation"]["pairs"]["bf16__ngram"]["decision"] == "go"
