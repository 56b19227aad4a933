"""Group-sequential gating end to end without a model: the quality stage's wave loop
(pipeline/quality/waves.py: Waves, score_in_waves) with injected per-item scorers, and the gate
stage's replay of the same looks (pipeline/gate/decision.py: build_gate). Shows: a clear fail and
a clear pass stop early, an identical copy passes within the maximum, the waves are deterministic
and an interrupted run re-uses what was scored; and, on the default config's slices (their real
items, clusters and looks), a byte-identical copy is go and planted damage no-go (issue 26)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pipeline.core.config import load_config
from pipeline.core.quality_config import QualityConfig
from pipeline.core.stage import StageContext
from pipeline.gate.decision import build_gate
from pipeline.gate.looks import plan
from pipeline.quality.waves import Waves, score_in_waves
from pipeline.quality.items import order_items
from pipeline.quality.items import slice_data as _slice_data


def _unit(*key) -> float:
    """A deterministic uniform number per key (the same item scores the same under any run)."""
    return int(hashlib.sha256(repr(key).encode()).hexdigest()[:12], 16) / 16**12


def reference_score(s, i):
    return float(_unit("ref", s, i) < 0.6)


def identical(s, i):
    return reference_score(s, i)


def damaged(rate):
    """The reference's correct items wrong with probability `rate` (diff about -0.6 * rate)."""
    return lambda s, i: 0.0 if _unit("dmg", s, i) < rate else reference_score(s, i)


def flips(rate):
    """Either way with probability `rate` each: an equivalent variant with some disagreement."""
    return lambda s, i: 1.0 - reference_score(s, i) if _unit("flip", s, i) < rate else reference_score(s, i)


def _probs(s, i, fn):
    label = int(_unit("label", s, i) * 4)
    pick = label if fn(s, i) == 1.0 else (label + 1) % 4
    probs = [0.1] * 4
    probs[pick] = 0.7
    return probs, label


def scorer(fn, calls: list):
    """A stand-in for pipeline.quality.evaluate.evaluate: scores the wave files it is handed."""
    def score(configs: dict, with_named: bool):
        out = {}
        for s, f in configs.items():
            rows = [json.loads(line) for line in Path(f).read_text().splitlines()]
            calls.append((s, [r["id"] for r in rows]))
            recs = []
            for r in rows:
                v = fn(s, r["id"])
                rec = {"id": r["id"], "cluster": r.get("cluster"), "slice": s, "group": r.get("group"),
                       "prompt_hash": None, "metric": "acc", "score": v, "scores": {"acc": v},
                       "prediction": "", "target": ""}
                if s == "calibration":
                    rec["option_probs"], rec["label"] = _probs(s, r["id"], fn)
                recs.append(rec)
            out[s] = recs
        return out, {}
    return score


def _config(tmp_path: Path, variants: dict, quality_yaml: str = ""):
    lines = "".join(f"    {n}: {{scheme: none}}\n" for n in variants)
    path = tmp_path / "cfg.yaml"
    path.write_text("device: cpu\nquantize:\n  reference: bf16\n  variants:\n"
                    "    bf16: {scheme: none, release: false}\n" + lines + quality_yaml)
    return load_config(path)


def independent_slice(name: str, n: int) -> bytes:
    return "".join(json.dumps({"id": f"{name}-{i:05d}", "cluster": f"{name}-{i:05d}", "prompt": f"q{i}"}) + "\n"
                   for i in range(n)).encode()


def run_waves(tmp_path: Path, cfg, data: dict[str, bytes], plans: dict, fns: dict, calls=None) -> dict:
    """The quality stage's loop over fake scorers, then quality/meta.json as the stage writes it
    and the gate stage's decision."""
    out = tmp_path / "run" / "quality"
    ctx = StageContext(name="quality", run_dir=out.parent, out_dir=out, config=cfg, args={},
                       input_hash="test", upstream={}, code="test")
    lines = {s: b.splitlines(keepends=True) for s, b in data.items()}
    for s, b in data.items():
        (out / "data").mkdir(parents=True, exist_ok=True)
        (out / "data" / f"{s}.jsonl").write_bytes(b)
    waves = Waves(out, lines, plans, [], lambda files: files)
    calls = {} if calls is None else calls
    items = {}
    for name in fns:
        inputs = {"name": name, "data": {s: hashlib.sha256(b).hexdigest() for s, b in data.items()}}
        items[name] = waves.open(ctx.item(name, inputs), inputs)
    ref_score = scorer(fns["bf16"], calls.setdefault("bf16", []))
    waves.first_look("bf16", ref_score)
    for name, fn in fns.items():
        if name != "bf16" and not items[name].fresh:
            score_in_waves(waves, "bf16", name, ref_score, scorer(fn, calls.setdefault(name, [])), cfg)
            waves.finish(name, "fake")
    waves.finish("bf16", "fake")
    (out / "meta.json").write_text(json.dumps({"slices": list(data), "tasks": [], "sequential": plans}))
    return build_gate(out.parent, cfg)


def _spent(gate, name, key):
    return gate["variants"][name]["slices"][key]["items_spent"]


def test_clear_fail_and_clear_pass_stop_early_identical_passes_within_the_max(tmp_path):
    n, wave = 1000, 100
    data = {"s": independent_slice("s", n)}
    plans = {"s": {"looks": plan(n, wave), "n_max": n}}
    fns = {"bf16": reference_score, "copy": identical, "broken": damaged(0.3), "close": flips(0.01),
           "margin": damaged(0.085)}
    cfg = _config(tmp_path, [k for k in fns if k != "bf16"], "quality: {wave_items: 100}\n")
    calls: dict = {}
    g = run_waves(tmp_path, cfg, data, plans, fns, calls)
    v = g["variants"]
    assert v["broken"]["decision"] == "no-go" and _spent(g, "broken", "s") <= 300
    assert v["copy"]["decision"] == "go" and _spent(g, "copy", "s") == 300
    assert v["close"]["decision"] == "go" and _spent(g, "close", "s") < n
    # Scored only what its looks needed: the fail stopped scoring; the reference scored the union.
    assert sum(len(ids) for _, ids in calls["broken"]) == _spent(g, "broken", "s")
    ref_lines = (tmp_path / "run/quality/bf16/s.jsonl").read_text().splitlines()
    assert len(ref_lines) == max(_spent(g, k, "s") for k in fns if k != "bf16")
    cell = v["copy"]["slices"]["s"]
    # gate.json records every look: n, bounds, nominal levels (O'Brien-Fleming: tiny early).
    assert [lk["n"] for lk in cell["looks"]] == [100, 200, 300]
    assert [lk["status"] for lk in cell["looks"]] == ["inconclusive", "inconclusive", "pass"]
    assert 0 < cell["looks"][0]["alpha_lower"] < cell["looks"][1]["alpha_lower"] < cell["looks"][2]["alpha_lower"] < 1e-3
    assert cell["planned_looks"] == plans["s"]["looks"] and cell["n_max"] == n
    # A variant near the margin (diff about -0.05) runs to the maximum and stays undecided there.
    assert _spent(g, "margin", "s") >= 600


def test_pocock_spending_stops_clear_cells_earlier_through_the_stage_and_the_gate(tmp_path):
    """gate.spending: pocock on the same fake variants and the default config's looks (240 items,
    waves of 40): the broken variant fails and the copy passes at earlier looks than under
    O'Brien-Fleming, the stage scores only what those looks need, and gate.json says which
    function drew the levels."""
    n, wave = 240, 40
    data = {"s": independent_slice("s", n)}
    plans = {"s": {"looks": plan(n, wave), "n_max": n}}
    fns = {"bf16": reference_score, "copy": identical, "broken": damaged(0.5)}
    spent = {}
    for spending in ("obf", "pocock"):
        (tmp_path / spending).mkdir()
        cfg = _config(tmp_path / spending, ["copy", "broken"],
                      f"quality: {{wave_items: {wave}}}\ngate: {{spending: {spending}}}\n")
        calls: dict = {}
        g = run_waves(tmp_path / spending, cfg, data, plans, fns, calls)
        assert g["spending"] == spending
        assert ("Pocock-type" in g["method"]) == (spending == "pocock")
        assert g["variants"]["copy"]["decision"] == "go" and g["variants"]["broken"]["decision"] == "no-go"
        spent[spending] = {v: _spent(g, v, "s") for v in ("copy", "broken")}
        assert sum(len(ids) for _, ids in calls["broken"]) == spent[spending]["broken"]
    assert spent["obf"] == {"copy": 160, "broken": 80}  # O'Brien-Fleming: look 1 decides nothing here
    assert spent["pocock"] == {"copy": 120, "broken": 40}


def test_waves_are_deterministic_and_an_interrupted_run_resumes(tmp_path):
    n, wave = 400, 100
    data = {"s": independent_slice("s", n)}
    plans = {"s": {"looks": plan(n, wave), "n_max": n}}
    fns = {"bf16": reference_score, "v": flips(0.03)}
    cfg = _config(tmp_path, ["v"])
    first = run_waves(tmp_path, cfg, data, plans, fns)
    vfile = tmp_path / "run/quality/v/s.jsonl"
    full = vfile.read_text()
    looks = len(full.splitlines()) // 100
    assert looks >= 3  # 3% flips each way: a few looks before it settles
    # Interrupt after the first look: the variant has 100 lines and no meta.json.
    vfile.write_text("".join(full.splitlines(keepends=True)[:100]))
    (tmp_path / "run/quality/v/meta.json").unlink()
    calls: dict = {}
    again = run_waves(tmp_path, cfg, data, plans, fns, calls)
    assert vfile.read_text() == full
    assert [len(ids) for _, ids in calls["v"]] == [100] * (looks - 1)  # the later looks only
    assert calls["bf16"] == []  # the reference had them all
    assert again["variants"]["v"] == first["variants"]["v"]
    # The order: seeded by run seed and slice, whole clusters together, the same every time.
    pool = b"".join(json.dumps({"id": f"x{i}", "cluster": f"c{i // 3}"}).encode() + b"\n" for i in range(30))
    a, ends = order_items(pool, 0, "x", 30)
    assert a == order_items(pool, 0, "x", 30)[0] != order_items(pool, 1, "x", 30)[0]
    assert ends == list(range(3, 31, 3))
    rows = [json.loads(x) for x in a.splitlines()]
    assert all(len({r["cluster"] for r in rows[e - 3:e]}) == 1 for e in ends)


def default_slices():
    """The default config's slices as the quality stage plans them: their real items (generated,
    BFCL's from the installed package), seeded cluster order, looks and maximum."""
    q = QualityConfig()
    data, plans = {}, {}
    for s in q.slices:
        blob, p = _slice_data(s, q, 0, object())
        data[s], plans[s] = blob, {"looks": p["looks"], "n_max": p["n_max"]}
    return data, plans


def test_default_config_identical_copy_is_go_and_planted_damage_no_go(tmp_path):
    pytest.importorskip("bfcl_eval")
    data, plans = default_slices()
    fns = {"bf16": reference_score, "copy": identical, "damaged": damaged(0.25)}
    cfg = _config(tmp_path, ["copy", "damaged"])
    g = run_waves(tmp_path, cfg, data, plans, fns)
    copy, dmg = g["variants"]["copy"], g["variants"]["damaged"]
    assert copy["decision"] == "go" and dmg["decision"] == "no-go" and g["decision"] == "no-go"
    spent = {k: c["items_spent"] for k, c in copy["slices"].items()}
    # docs/methods/gate.md, "The default CPU config's items": what an identical copy spends per slice.
    assert spent == {"reasoning": 160, "language": 160, "tool_args": 160,
                     "calibration": 160, "calibration:brier": 200}
    assert all(c["items_spent"] <= plans[k.split(":")[0]]["n_max"] for k, c in dmg["slices"].items())
    assert any(c["status"] == "fail" and c["items_spent"] < 240 for c in dmg["slices"].values())
