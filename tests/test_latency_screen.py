"""Screening a pair before timing it (issue 27, pipeline/latency/screen.py): the bound on tiny random
Llamas with hand-made acceptance records, checked against a timed pair, and a screened pair through
the latency stage, the marginal stage and the report.

Timing on a shared CPU: other processes only make the bound looser (T_plain_hi is the slowest
probe repeat, the round's parts the fastest), but under heavy load a tiny model's steps vary
from 2 to 200 ms. So the drafts that must not pay sleep SLEEP_S in every forward (a pre-hook: time
that no contention can shorten, and far above a loaded tiny plain step), and the checks that a
pair does not pay retry a few times before they fail; a check that a pair may pay needs neither."""
from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import make_tiny_llama, save_as_prepared

from pipeline.core.config import Config
from pipeline.core.stage import SCHEMA_VERSION
from pipeline.decode.drafts import ModelDraft, NgramDraft
from pipeline.latency.screen import DOES_NOT_PAY, MAY_PAY, bound_rows, cut_line, e_upper, ks_to_time, screen_pair, verdict_of

CPU = torch.device("cpu")
SLEEP_S = 0.25
ACC = Config.model_validate({"acceptance": {"temperatures": [0.0, 0.7]}}).acceptance
KS = [1, 2, 3]


def fake_acceptance(hi: dict[int, float], temps=("0.0", "0.7")) -> dict:
    """An acceptance JSON with only what the screen reads: slice "all", E(k) CIs."""
    block = {"expected_tokens_per_round": {str(k): 1.0 for k in hi},
             "expected_tokens_per_round_ci": {str(k): [1.0, v] for k, v in hi.items()}}
    return {"slices": {"all": {t: block for t in temps}}}


class FreeDraft:
    """A draft with a model (so it is screened) whose proposal costs nothing: the last k tokens."""

    spec = "free"

    def __init__(self, model):
        self.model = model

    def prefill(self, input_ids, max_len, exact=False):
        pass

    def propose(self, seq, k, sampling, generator):
        return seq[-k:], None

    def accept(self, n):
        pass


def slow(model):
    """`model` with every forward at least SLEEP_S long (a draft costlier than the tiny target)."""
    model.register_forward_pre_hook(lambda module, args: time.sleep(SLEEP_S))
    return model


@pytest.fixture(scope="module")
def costly_draft(tiny_tokenizer):
    """A draft far costlier than the tiny target: its own copy of a tiny Llama, every forward >= SLEEP_S."""
    return ModelDraft("slow", slow(make_tiny_llama(tiny_tokenizer, seed=1)), len(tiny_tokenizer))


def test_e_upper_reads_the_largest_upper_end_and_falls_back_to_k_plus_1():
    acc = fake_acceptance({1: 1.2, 2: 1.3})
    acc["slices"]["all"]["0.7"] = {**acc["slices"]["all"]["0.7"],
                                   "expected_tokens_per_round_ci": {"1": [1.0, 1.25], "2": [1.0, 1.28]}}
    up = e_upper(acc, [1, 2, 3])
    assert up[1]["e_hi"] == 1.25 and up[2]["e_hi"] == 1.3  # the larger over temperatures
    assert up[3]["e_hi"] == 4.0 and up[3]["source"].startswith("k + 1")  # no CI at k = 3
    assert e_upper(None, [2])[2]["e_hi"] == 3.0  # no acceptance JSON: the most a round can emit


def test_bound_formula_on_given_timings():
    """upper_speedup(k) = E_hi(k) x max(plain) / (min(verify(k+1)) + min(draft(k)))."""
    probe = {"plain_ms": [10.0, 12.0, 11.0], "verify_ms": {"2": [11.0, 10.5], "3": [12.0, 13.0]},
             "draft_ms": {"1": [4.0, 3.0], "2": [7.0, 6.0]}}
    rows = bound_rows(e_upper(fake_acceptance({1: 1.2, 2: 1.5}), [1, 2]), probe, [1, 2])
    assert rows[0]["bound"] == pytest.approx(1.2 * 12.0 / (10.5 + 3.0))
    assert rows[1]["bound"] == pytest.approx(1.5 * 12.0 / (12.0 + 6.0))
    verdict, top, at = verdict_of(rows)
    assert verdict == MAY_PAY and at["k"] == 1 and top == pytest.approx(rows[0]["bound"])
    assert rows[1]["bound"] == pytest.approx(1.0)  # at 1: may pay (speculation is not slower)
    rows[0]["bound"] = 0.99
    assert verdict_of(rows)[0] == MAY_PAY
    rows[1]["bound"] = 0.98
    assert verdict_of(rows)[0] == DOES_NOT_PAY


def _does_not_pay(screen, attempts: int = 3) -> dict:
    for _ in range(attempts):  # contention only raises the bound (module docstring)
        rec = screen()
        if rec["verdict"] == DOES_NOT_PAY:
            return rec
    return rec


def test_costly_draft_with_low_acceptance_does_not_pay(tiny_model, tiny_tokenizer, costly_draft):
    ks = [1, 2]
    ids = tiny_tokenizer.encode("the quick brown fox jumps over the lazy dog")
    acc = fake_acceptance({k: 1.05 for k in ks})
    rec = _does_not_pay(lambda: screen_pair(tiny_model, costly_draft, ids, ks, acc, ACC, CPU, 64, prompt_id="p0"))
    assert rec["verdict"] == DOES_NOT_PAY and rec["max_bound"] < 1.0, rec["rows"]
    assert [r["k"] for r in rec["rows"]] == ks and all(r["bound"] < 1.0 for r in rec["rows"])
    assert all(r["t_draft_lo_ms"] >= 1e3 * SLEEP_S * r["k"] for r in rec["rows"])  # k forwards of the draft
    for r in rec["rows"]:
        assert r["e_hi"] == 1.05 and r["e_hi_source"] == "acceptance CI, slice all"
        assert r["t_plain_hi_ms"] == max(rec["probe"]["plain_ms"])
        assert r["t_verify_lo_ms"] == min(rec["probe"]["verify_ms"][str(r["k"] + 1)])
        assert r["t_draft_lo_ms"] == min(rec["probe"]["draft_ms"][str(r["k"])])
    p = rec["probe"]
    assert p["prompt_id"] == "p0" and p["prompt_tokens"] == len(ids) and p["probes"] == 2
    assert len(p["plain_ms"]) == p["repeats"] == 6  # a second probe confirmed it, pooled
    assert rec["reason"].startswith("speedup at most") and rec["assumes"] and "E_hi" in rec["formula"]
    json.dumps(rec)  # JSON-able


def test_prompt_lookup_is_never_screened(tiny_model, tiny_tokenizer):
    ids = tiny_tokenizer.encode("the cat sat on the mat")
    acc = fake_acceptance({k: 1.0 for k in KS})  # no acceptance at all: still never screened
    rec = screen_pair(tiny_model, NgramDraft("ngram"), ids, KS, acc, ACC, CPU, 64)
    assert rec["verdict"] == MAY_PAY and rec["model_free"] and rec["probe"] is None and rec["rows"] == []
    assert "never screened" in rec["reason"]


def test_free_draft_with_high_acceptance_may_pay(tiny_model, tiny_tokenizer):
    ids = tiny_tokenizer.encode("the quick brown fox jumps over the lazy dog")
    rec = screen_pair(tiny_model, FreeDraft(tiny_model), ids, KS, fake_acceptance({k: k + 0.9 for k in KS}), ACC,
                      CPU, 64)
    assert rec["verdict"] == MAY_PAY and rec["max_bound"] > 1.0 and not rec["model_free"]
    assert rec["probe"] is not None  # (per-k bounds near k = 1 move with the machine's load; the verdict is the claim)


def _rows(bounds: list[float]) -> list[dict]:
    return [{"k": k, "bound": b} for k, b in enumerate(bounds, 1)]


def test_ks_to_time_keeps_the_prefix_up_to_the_last_k_that_may_pay():
    """By hand: the k timed are 1..k_hi (k_hi the largest k whose bound reaches 1), a k below k_hi is kept whatever its own bound, the rest are returned with
    their bounds; a model-free, unscreened or does-not-pay record keeps every k."""
    ks = [1, 2, 3, 4, 5, 6]
    b1 = {"verdict": MAY_PAY, "rows": _rows([1.052, 1.045, 0.966, 0.906, 0.834, 0.776])}
    assert ks_to_time(b1, ks) == ([1, 2], {"3": 0.966, "4": 0.906, "5": 0.834, "6": 0.776})
    dip = {"verdict": MAY_PAY, "rows": _rows([0.98, 1.02, 0.9])}
    assert ks_to_time(dip, [1, 2, 3]) == ([1, 2], {"3": 0.9})
    none_cut = {"verdict": MAY_PAY, "rows": _rows([1.2, 1.1, 1.0])}
    assert ks_to_time(none_cut, [1, 2, 3]) == ([1, 2, 3], {})
    assert ks_to_time({"verdict": MAY_PAY, "model_free": True, "rows": []}, ks) == (ks, {})
    assert ks_to_time({"verdict": DOES_NOT_PAY, "rows": _rows([0.9] * 6)}, ks) == (ks, {})
    assert ks_to_time({"verdict": MAY_PAY, "max_bound": None, "reason": "not screened: x"}, ks) == (ks, {})
    assert ks_to_time({"verdict": MAY_PAY, "rows": _rows([1.1, 0.9])}, [1, 2, 3]) == ([1, 2, 3], {})  # k = 3 unbounded
    assert cut_line([1, 2], {"3": 0.966, "4": 0.906}) == \
        "k = 3..4 not timed: speedup at most 0.97 there (at k = 3; timed at k = 1..2)"
    assert cut_line([1], {"2": 0.5}) == "k = 2 not timed: speedup at most 0.50 there (at k = 2; timed at k = 1)"
    assert cut_line([1, 2, 3], {}) == ""
    assert "at most 0.997 there" in cut_line([1], {"2": 0.9966})


def test_a_k_past_the_bound_is_cut_only_after_a_second_probe(tiny_model, tiny_tokenizer, costly_draft):
    """A draft far dearer than the target with E_hi(1) huge and E_hi(2, 3) = 1: k = 1 may pay, k = 2
    and 3 cannot (their bound is at most plain / (2 x SLEEP_S)), so the pair is timed at k = 1 only,
    and the cut rests on two pooled probes."""
    ids = tiny_tokenizer.encode("the quick brown fox jumps over the lazy dog")
    rec = screen_pair(tiny_model, costly_draft, ids, KS, fake_acceptance({1: 1e6, 2: 1.0, 3: 1.0}), ACC, CPU, 64)
    assert rec["verdict"] == MAY_PAY and rec["probe"]["probes"] == 2
    ks, cut = ks_to_time(rec, KS)
    assert ks == [1] and set(cut) == {"2", "3"} and all(v < 1.0 for v in cut.values())


def test_bound_is_above_the_measured_speedup(tiny_tokenizer):
    """The bound against a timed pair: a tiny Llama drafting for itself (greedy, every token
    accepted, so E(k) = k + 1 exactly and its CI is [k + 1, k + 1]), every forward of it slowed by
    30 ms (so a forward costs about the same at every width, as on a GPU at small batch, and other
    processes on a shared CPU move it less). The median measured speedup (speculative_pair, 3
    repeats) must be at most the bound at every k, with 10% tolerance for the timing noise between
    the probe and the timed runs (on a quiet machine it is 10-30% below). Under heavy load a burst
    can still hit one side only, so up to 3 attempts (probe and timed pair each): a bound that is
    wrong by construction fails every one."""
    from pipeline.latency.memory import cache_len
    from pipeline.latency.speculative import speculative_pair

    model = make_tiny_llama(tiny_tokenizer)
    model.register_forward_pre_hook(lambda module, args: time.sleep(0.03))
    acc_cfg = Config.model_validate({"acceptance": {"temperatures": [0.0]}}).acceptance
    lat = Config.model_validate({"latency": {"new_tokens": 8, "warmup": 1, "repeats": 3}}).latency
    prompts = {"chat": [("chat-0", tiny_tokenizer.encode("the cat sat on the mat"))]}
    draft = ModelDraft("self:tiny", model, len(tiny_tokenizer))
    acc = fake_acceptance({k: float(k + 1) for k in KS}, temps=("0.0",))
    seen = []
    for _ in range(3):
        rec = screen_pair(model, draft, prompts["chat"][0][1], KS, acc, acc_cfg, CPU,
                          cache_len(len(prompts["chat"][0][1]), lat.new_tokens))
        out = speculative_pair("tiny", "self:tiny", model, draft, prompts, lat, acc_cfg, CPU, 0.95, 0, KS)
        assert all(row["tokens_per_round"] <= row["k"] + 1 for row in out["rows"])  # what E_hi = k + 1 bounds
        pairs = [(row["k"], row["speedup"]["median"], r["bound"]) for row, r in zip(out["rows"], rec["rows"])]
        seen.append(pairs)
        if all(measured <= 1.10 * bound for _, measured, bound in pairs):
            break
    else:
        pytest.fail(f"measured speedup above the bound in every attempt (k, measured, bound): {seen}")


def _fake_stage(run, name, **extra):
    (run / name).mkdir(parents=True, exist_ok=True)
    (run / name / "meta.json").write_text(json.dumps({"stage": name, "schema": SCHEMA_VERSION, "input_hash": name, **extra}))


def _screen_run(tmp_path, tiny_model, tiny_tokenizer, monkeypatch, acc: dict):
    """A run folder for the latency stage: variants bf16 and big (the same tiny Llama), the draft
    self:big slowed (every forward >= SLEEP_S), the given acceptance JSON; returns (run, raw config)."""
    from pipeline.stages import latency as stage

    build = stage.build_draft
    monkeypatch.setattr(stage, "build_draft", lambda spec, *a: ModelDraft(spec, slow(build(spec, *a).model),
                                                                            len(tiny_tokenizer)))
    run = tmp_path / "run"
    save_as_prepared(tiny_model, tiny_tokenizer, run / "variants" / "bf16")
    save_as_prepared(tiny_model, tiny_tokenizer, run / "variants" / "big")
    _fake_stage(run, "variants", variants={"bf16": {"scheme": "none", "dir": "variants/bf16"}})
    _fake_stage(run, "drafts")
    _fake_stage(run, "acceptance")
    (run / "acceptance" / "bf16__self-big.json").write_text(json.dumps(acc))
    raw = {"device": "cpu", "drafts": ["self:big"],
           "quantize": {"reference": "bf16", "variants": {"bf16": {"scheme": "none"}}},
           "acceptance": {"k_max": 2, "prompts_per_kind": 1, "temperatures": [0.0]},
           "latency": {"batch_sizes": [1], "context_lengths": [8], "new_tokens": 3, "warmup": 0, "repeats": 2,
                       }}
    return run, raw


def test_screened_pair_flows_through_latency_marginal_and_report(tmp_path, tiny_model, tiny_tokenizer, capsys,
                                                                monkeypatch):
    """A draft far costlier than the target (self:big, slowed) with E(k) near 1: the latency stage
    writes its JSON with `screened` and nothing timed, says so in one line, and
    a re-run keeps them; the marginal stage gives k = 0 with the reason, the .md page and the plot;
    the report says "does not pay" and what was skipped. With latency.screen off the pair is timed
    (only it: the timing functions are stand-ins here)."""
    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage
    from pipeline.report.document import to_markdown
    from pipeline.report.speculation import speculation_blocks
    from pipeline.stages import latency as stage

    acc = fake_acceptance({1: 1.08, 2: 1.1}, temps=("0.0",))
    acc["slices"]["all"]["0.0"]["per_position"] = [
        {"position": i, "conditional": 0.05, "prefix": 0.05 ** i, "expected_beta": 0.1, "n": 10,
         "ci": [0.0, 0.2]} for i in (1, 2)]
    run, raw = _screen_run(tmp_path, tiny_model, tiny_tokenizer, monkeypatch, acc)
    cfg = Config.model_validate(raw)
    meta = {}
    for _ in range(3):  # contention only raises the bound (module docstring)
        meta = json.loads(run_stage(STAGES["latency"], run, cfg, {}, STAGES, force=True).read_text())
        if meta["screened"]["bf16__self-big"]["speculative"]["verdict"] == DOES_NOT_PAY:
            break
        for path in (run / "latency").rglob("bf16__self-big.json"):
            path.unlink()
    err = capsys.readouterr().err
    assert "latency: bf16 + self:big: does not pay (speedup at most" in err and "), not timed" in err
    assert meta["screened"]["bf16__self-big"]["speculative"]["max_bound"] < 1.0
    pair = json.loads((run / "latency" / "bf16__self-big.json").read_text())
    assert pair["screened"]["verdict"] == DOES_NOT_PAY and pair["rows"] == [] and pair["by_temperature"] == {}
    assert pair["screened"]["acceptance"]["file"] == "acceptance/bf16__self-big.json"
    assert "B = 1 round times" in pair["screened"]["skipped"]
    assert "bf16__self-big" not in meta["memory_plan"]["speculative"]  # nothing ran
    before = (run / "latency" / "bf16__self-big.json").read_text()
    meta = json.loads(run_stage(STAGES["latency"], run, cfg, {}, STAGES, force=True).read_text())
    assert (run / "latency" / "bf16__self-big.json").read_text() == before  # resumed: screened stays
    assert meta["screened"]["bf16__self-big"]["speculative"]["verdict"] == DOES_NOT_PAY

    run_stage(STAGES["marginal"], run, cfg, {}, STAGES)
    rep = json.loads((run / "marginal" / "bf16__self-big.json").read_text())
    assert rep["recommended_k"] == 0 and rep["rows"] == [] and rep["screened"]["verdict"] == DOES_NOT_PAY
    assert rep["screened_note"].startswith("does not pay: speedup at most ") and "not timed" in rep["screened_note"]
    assert rep["recommended_k_by_batch"] is None and "measured in vLLM" in rep["by_batch_note"]
    md = (run / "marginal" / "bf16__self-big.md").read_text()
    assert "Recommended k = 0: do not speculate." in md and "does not pay: speedup at most" in md
    assert "Not timed: B = 1 round times" in md
    assert (run / "marginal" / "bf16__self-big.png").read_bytes()[:4] == b"\x89PNG"

    figures: dict[str, bytes] = {}
    text = to_markdown("t", speculation_blocks(run, {}, figures, 60))
    assert "0 (does not pay, not timed)" in text and "does not pay: speedup at most" in text
    assert "skipped: B = 1 round times" in text
    assert "speed-bf16__self-big.png" in figures

    timed = []
    monkeypatch.setattr(stage, "speculative_pair", lambda target, spec, *a, **kw: timed.append(spec) or {
        "variant": target, "draft": spec, "rows": [{"k": 1}], "memory_plan": {}})
    off = Config.model_validate({**raw, "latency": {**raw["latency"], "screen": False}})
    assert meta["screen"] == "on"
    meta = json.loads(run_stage(STAGES["latency"], run, off, {}, STAGES).read_text())
    assert meta["screen"].startswith("off") and "latency: screen off" in capsys.readouterr().err
    assert timed == ["self:big"]  # the plain grid stays: screen is no timing input
    pair = json.loads((run / "latency" / "bf16__self-big.json").read_text())
    assert "screened" not in pair and "screen" not in pair and pair["rows"] == [{"k": 1}]


def test_the_stage_times_a_pair_only_at_the_k_that_may_pay(tmp_path, tiny_model, tiny_tokenizer, capsys,
                                                           monkeypatch):
    """The latency stage with a draft far dearer than the target, E_hi(1) huge and E_hi(2) = 1: the
    pair is timed at k = 1 only (the timing function is a stand-in that records the k it is given),
    its JSON and meta.json name k = 2 with its bound, a line
    says so; a re-run keeps the pair; with latency.screen off it is timed at every k."""
    from pipeline.__main__ import STAGES
    from pipeline.core.stage import run_stage
    from pipeline.stages import latency as stage

    run, raw = _screen_run(tmp_path, tiny_model, tiny_tokenizer, monkeypatch,
                           fake_acceptance({1: 1e6, 2: 1.0}, temps=("0.0",)))
    timed = []
    monkeypatch.setattr(stage, "speculative_pair",
                        lambda target, spec, model, draft, prompts, lat, acc, device, conf, seed, ks, **kw:
                        timed.append(("b1", list(ks))) or {"variant": target, "draft": spec,
                                                           "rows": [{"k": k} for k in ks], "memory_plan": {}})
    cfg = Config.model_validate(raw)
    meta = json.loads(run_stage(STAGES["latency"], run, cfg, {}, STAGES, force=True).read_text())
    assert timed == [("b1", [1])]
    err = capsys.readouterr().err
    assert "latency: bf16 + self:big: k = 2 not timed: speedup at most" in err
    for path in (run / "latency" / "bf16__self-big.json",):
        doc = json.loads(path.read_text())
        assert doc["ks_asked"] == [1, 2] and doc["ks_timed"] == [1] and set(doc["ks_not_timed"]) == {"2"}
        assert doc["ks_not_timed"]["2"] < 1.0 and doc["screen"]["ks_not_timed"] == doc["ks_not_timed"]
    for phase in ("speculative",):
        assert set(meta["screened"]["bf16__self-big"][phase]["ks_not_timed"]) == {"2"}
    run_stage(STAGES["latency"], run, cfg, {}, STAGES)
    assert len(timed) == 1  # resumed: the cut pair is current
    off = Config.model_validate({**raw, "latency": {**raw["latency"], "screen": False}})
    run_stage(STAGES["latency"], run, off, {}, STAGES)
    assert timed[1:] == [("b1", [1, 2])]
    doc = json.loads((run / "latency" / "bf16__self-big.json").read_text())
    assert doc["ks_timed"] == [1, 2] and doc["ks_not_timed"] == {}
