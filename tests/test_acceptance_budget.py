"""The acceptance stage under a time budget (issue 27): the direct check is planned to what is left
once the measurement (texts, teacher-forced passes, the sampled lossless test) is done, runs
round-robin over the categories, and records what it ran and skipped; without a budget it is the
direct check it always was. The planner by hand (a fake clock), measure_pair on the tiny random
Llama, and the stage end to end with a budget too small for any direct run (the gate still reads
its JSON)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from pipeline.speculation.measure import MIN_DIRECT_PROMPTS, PRIOR_DIRECT_PER_TEXT_S, CheckPlan, planned_runs
from tests.conftest import save_as_prepared


class Tick:
    """A clock that advances one second each time it is read: every run costs 1 s."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now - 1.0


def _cells(log):
    return [(name, key, lambda ids, name=name: log.append((name, ids[0])) or {"ids": ids})
            for name, key in (("a", "0.0"), ("b", "0.0"), ("c", "0.7"))]


ORDER = [(f"p{i}", [i]) for i in range(5)]


def test_planner_without_a_budget_runs_everything_cell_by_cell():
    log = []
    out, ran = planned_runs(_cells(log), ORDER, math.inf, CheckPlan(clock=Tick()))
    assert log == [(c, i) for c in "abc" for i in range(5)]  # each cell over every prompt, in turn
    assert ran["prompts_run"] == [p for p, _ in ORDER] and ran["prompts_skipped"] == [] and ran["stopped"] is None
    assert set(out["c"]) == {p for p, _ in ORDER}


def test_planner_stops_at_the_first_prompt_that_does_not_fit():
    log, seen = [], []
    plan = CheckPlan(clock=Tick(), on_progress=lambda *a: seen.append(a))
    # 3 runs of 1 s per prompt; nothing timed yet and no text times: the first prompt runs, then
    # each is planned at 3 s: 7 s of allotment holds two prompts.
    out, ran = planned_runs(_cells(log), ORDER, 7.0, plan)
    assert log == [(c, i) for i in range(2) for c in "abc"]  # prompt by prompt through every cell
    assert ran == {"prompts_run": ["p0", "p1"], "prompts_skipped": ["p2", "p3", "p4"], "stopped": "budget",
                   "spent_s": 6.0, "next_prompt_s": 3.0}
    assert [s[:3] for s in seen] == [(3, 15, 3.0), (6, 15, 6.0)] and seen[-1][3] == pytest.approx(9.0)
    # Planned from each prompt's plain-text time: p2's text took 4x p0's, so its runs would too.
    text_s = {"0.0": {"p0": 1.0, "p1": 1.0, "p2": 4.0}, "0.7": {"p0": 1.0, "p1": 1.0, "p2": 4.0}}
    _, ran = planned_runs(_cells([]), ORDER, 10.0, CheckPlan(clock=Tick(), text_s=text_s))
    # Before any run, PRIOR_DIRECT_PER_TEXT_S x 3 texts (6 s) fits; then 1 s per text-second.
    assert PRIOR_DIRECT_PER_TEXT_S * 3 <= 10.0
    assert ran["prompts_run"] == ["p0", "p1"] and ran["next_prompt_s"] == pytest.approx(12.0)
    # Nothing allotted: the first prompt runs all the same (the greedy lossless check needs one),
    # every other prompt is skipped.
    log = []
    _, ran = planned_runs(_cells(log), ORDER, 0.0, CheckPlan(clock=Tick()))
    assert MIN_DIRECT_PROMPTS == 1
    assert log == [(c, 0) for c in "abc"] and ran["prompts_run"] == ["p0"]
    assert len(ran["prompts_skipped"]) == 4 and ran["stopped"] == "budget"


@pytest.fixture(scope="module")
def tiny_pair(tiny_model, tiny_tokenizer):
    from pipeline.core.config import Config
    from pipeline.speculation.measure import generate_texts
    from pipeline.speculation.workload import workload_prompts

    config = Config.model_validate({"acceptance": {"k_max": 3, "max_new_tokens": 12, "prompts_per_kind": 2,
                                                   "temperatures": [0.0, 0.7], "lossless_samples": 16,
                                                   "direct_check_k": [1, 2],
                                                   "categories": ["chat", "code", "structured"]}})
    cfg = config.acceptance
    prompts = workload_prompts(config, tiny_tokenizer, "test")
    texts = generate_texts(tiny_model, prompts, cfg, 0, tiny_tokenizer.eos_token_id)
    return cfg, prompts, texts


NEW_KEYS = {"prompts_run", "prompts_skipped", "stopped"}


def test_without_a_budget_the_direct_check_is_what_it_was(tiny_model, tiny_tokenizer, tiny_pair):
    """No plan (or the stage's plan without a budget): every prompt, each (temperature, k) cell's
    seeded generator drawing over the prompts category by category, as before issue 27."""
    from draft_models.registry import build_draft
    from pipeline.speculation.acceptance_stats import direct_check
    from pipeline.speculation.measure import direct_run, measure_pair, sampling_of, temp_key

    cfg, prompts, texts = tiny_pair
    draft = build_draft("layerskip:2", tiny_model, tiny_tokenizer, None, torch.device("cpu"))
    result = measure_pair(tiny_model, tiny_tokenizer, draft, cfg, 0, prompts, texts)
    planned = measure_pair(tiny_model, tiny_tokenizer, draft, cfg, 0, prompts, texts,
                           plan=CheckPlan(allot=lambda s: math.inf, text_s=None))
    assert json.dumps(planned, sort_keys=True) == json.dumps(result, sort_keys=True)
    everyone = [pid for rows in prompts.values() for pid, _ in rows]
    assert result["direct_check_plan"] == {"order": "category by category", "runs_per_prompt": 4,
                                           "prompts_run": everyone, "prompts_skipped": [], "stopped": None}
    for ti, t in enumerate(cfg.temperatures):  # the direct check as it was computed before budgets
        sampling, key = sampling_of(cfg.sampling, t), temp_key(t)
        runs = {}
        for k in (1, 2):
            g = torch.Generator("cpu").manual_seed(100 * k + ti + 17)
            runs[k] = {pid: direct_run(tiny_model, draft, ids, k, sampling, cfg.max_new_tokens,
                                       tiny_tokenizer.eos_token_id, g)
                       for rows in prompts.values() for pid, ids in rows}
        for name, by_t in result["slices"].items():
            block = by_t[key]
            pids = [r["prompt"] for r in block["per_prompt"]]
            want = direct_check(block["per_prompt"], {k: [runs[k][p] for p in pids] for k in runs},
                                sampling.greedy, 0.95, exact=True)
            got = block["direct_check"]
            assert set(got) == {"1", "2"}
            for k, entry in got.items():
                assert {x: v for x, v in entry.items() if x not in NEW_KEYS} == want[k], (name, key, k)
                assert entry["prompts_run"] == pids and entry["prompts_skipped"] == [] and entry["stopped"] is None
    assert result["lossless"]["prompts"] == len(everyone) and result["lossless"]["prompts_skipped"] == []
    assert result["lossless"]["greedy_identical"]


def test_a_tight_budget_runs_fewer_prompts_round_robin_and_says_so(tiny_model, tiny_tokenizer, tiny_pair):
    from draft_models.registry import build_draft
    from pipeline.speculation.measure import measure_pair
    from pipeline.speculation.workload import interleave

    cfg, prompts, texts = tiny_pair
    draft = build_draft("ngram", tiny_model, tiny_tokenizer, None, torch.device("cpu"))
    full = measure_pair(tiny_model, tiny_tokenizer, draft, cfg, 0, prompts, texts)
    asked = []
    # 4 runs per prompt at 1 s each (the fake clock): 9 s hold two prompts.
    plan = CheckPlan(allot=lambda s: asked.append(s) or 9.0, budgeted=True, clock=Tick())
    cut = measure_pair(tiny_model, tiny_tokenizer, draft, cfg, 0, prompts, texts, plan=plan)
    order = [pid for pid, _ in interleave(prompts)]  # chat-0, code-0, structured-0, chat-1, ...
    run, skipped = order[:2], order[2:]
    flat = [pid for rows in prompts.values() for pid, _ in rows]  # a slice lists its prompts in this order
    by_slice = sorted(skipped, key=flat.index)
    assert len(asked) == 1 and asked[0] > 0  # asked once, after the measurement
    assert cut["direct_check_plan"] == {"order": "round-robin over the categories", "runs_per_prompt": 4,
                                        "prompts_run": run, "prompts_skipped": skipped, "stopped": "budget"}
    assert plan.record["allotted_s"] == 9.0 and plan.record["spent_s"] == 8.0
    kinds = list(prompts)
    for t, block in cut["slices"]["all"].items():
        # The measurement is whole: the derived figures are the exhaustive run's.
        assert block["expected_tokens_per_round"] == full["slices"]["all"][t]["expected_tokens_per_round"]
        for k, entry in block["direct_check"].items():
            assert entry["prompts"] == 2 and entry["prompts_run"] == run and entry["prompts_skipped"] == by_slice
            assert entry["stopped"] == "budget"
        if t == "0.0":  # greedy in float32: the check on the prompts run is exact, and agrees
            assert all(e["agree"] for e in block["direct_check"].values())
    for kind in kinds:  # a category with a prompt run has its check on it; the third has none
        entries = cut["slices"][kind]["0.7"]["direct_check"]
        if kind in {"chat", "code"}:
            assert all(e["prompts"] == 1 and e["agree"] is None and "too few" in e["no_verdict"]
                       for e in entries.values())
        else:
            assert entries == {}
    # The greedy lossless check compared the prompts run; the sampled test is the exhaustive run's.
    loss = cut["lossless"]
    assert loss["prompts"] == 2 and loss["prompts_skipped"] == by_slice
    assert loss["greedy_identical"] and loss["sampling"] == full["lossless"]["sampling"]
    json.dumps(cut)
    # Nothing left for the check: the first prompt of the round-robin order runs all the same
    # (MIN_DIRECT_PROMPTS), so the greedy verdict is made on it; the sampled test is still there.
    none = measure_pair(tiny_model, tiny_tokenizer, draft, cfg, 0, prompts, texts,
                        plan=CheckPlan(allot=lambda s: 0.0, budgeted=True))
    first = none["direct_check_plan"]["prompts_run"]
    assert len(first) == 1 and first[0].startswith(kinds[0]) and none["direct_check_plan"]["stopped"] == "budget"
    assert all(s["direct_check"] == {} for kind, by_t in none["slices"].items() if kind not in ("all", kinds[0])
               for s in by_t.values())
    assert none["lossless"]["greedy_lossless"] is True and none["lossless"]["prompts"] == 1
    assert none["lossless"]["sampling"]["p_value"] is not None


def test_a_model_draft_is_prefilled_once_for_the_sampled_lossless_test(tiny_model, tiny_tokenizer):
    """first_verified_tokens rewinds a model draft's prompt instead of refilling it per sample:
    the same draws as a fresh prefill for every sample (the loop before issue 27)."""
    from draft_models.registry import build_draft
    from pipeline.decode.sampling import SamplingParams
    from pipeline.speculation.lossless import first_verified_tokens

    ids = tiny_tokenizer("def add(a, b): return a + b")["input_ids"]
    params = SamplingParams(1.0)
    draft = build_draft("layerskip:2", tiny_model, tiny_tokenizer, None, torch.device("cpu"))
    got = first_verified_tokens(tiny_model, ids, draft, params, torch.Generator().manual_seed(3), 12)
    assert got == _fresh_prefill_each_sample(tiny_model, ids, draft, params, torch.Generator().manual_seed(3), 12)


@torch.inference_mode()
def _fresh_prefill_each_sample(model, ids, draft, params, g, samples):
    from pipeline.decode.cache import CachedModel
    from pipeline.decode.engine import speculative_step
    from pipeline.decode.sampling import logits_to_probs, pick
    from pipeline.decode.timing import Timer

    x = torch.tensor([ids])
    cached = CachedModel(model, batch=1, max_len=len(ids) + 3)
    first_probs = logits_to_probs(cached.forward(x, all_logits=False)[:, -1], params)
    out = []
    for _ in range(samples):
        cached.rollback(len(ids))
        first = pick(first_probs, params, g)
        draft.prefill(x, len(ids) + 3)
        new = speculative_step(cached, draft, torch.cat([x[0], first]), 1, params, g, Timer("cpu", enabled=False))[0]
        out.append(new[0])
    return out


@pytest.fixture
def tiny_run(tmp_path, tiny_model, tiny_tokenizer):
    run = tmp_path / "run"
    save_as_prepared(tiny_model, tiny_tokenizer, run / "variants" / "bf16")
    (run / "variants" / "meta.json").write_text(json.dumps({"input_hash": "test"}))
    return run


def test_stage_with_a_budget_too_small_for_any_direct_run(tiny_run):
    """A budget that allots nothing to the direct check: each pair still runs its first prompt
    (MIN_DIRECT_PROMPTS), so the greedy lossless check is made, and skips the rest."""
    from pipeline.__main__ import STAGES
    from pipeline.core.config import load_config
    from pipeline.core.stage import run_stage
    from pipeline.gate.speculation import speculation

    cfg = load_config("configs/smoke.yaml", {"drafts": ["ngram", "layerskip:2"], "device": "cpu",
                                             "budget": {"minutes": 0.001}})
    run_stage(STAGES["drafts"], tiny_run, cfg, {}, STAGES)
    meta = json.loads(run_stage(STAGES["acceptance"], tiny_run, cfg, {}, STAGES).read_text())
    budget = meta["budget"]
    assert budget["minutes"] == 0.001 and budget["share"] == cfg.budget.shares["acceptance"] and budget["estimates"]
    assert "exceeds the stage's share" in budget["estimates"][0]["what"]
    assert [s["what"].split(":")[0] for s in budget["skipped"]] == ["bf16__ngram", "bf16__layerskip-2"]
    for name in ("bf16__ngram", "bf16__layerskip-2"):
        check = meta["direct_check"][name]
        assert check["prompts_run"] == 1 and check["stopped"] == "budget" and check["allotted_s"] == 0.0
        assert check["prompts_skipped"] >= 1
        data = json.loads((tiny_run / "acceptance" / f"{name}.json").read_text())
        plan = data["direct_check_plan"]
        assert plan["stopped"] == "budget" and len(plan["prompts_run"]) == 1
        assert data["slices"]["all"]["0.0"]["expected_tokens_per_round"]  # the measurement is whole
        assert data["lossless"]["prompts"] == 1 and data["lossless"]["sampling"]["p_value"] is not None
        assert data["lossless"]["greedy_identical"] is True  # float32: the engine's texts are the plain ones
    # The gate reads the pairs: the greedy comparison ran on one prompt and the sampled test.
    verdicts = speculation(tiny_run, "holm")
    assert set(verdicts["pairs"]) == {"bf16__ngram", "bf16__layerskip-2"}
    for pair in verdicts["pairs"].values():
        assert pair["greedy_lossless"] is True and pair["prompts"] == 1 and pair["decision"] in {"go", "no-go"}
    # Without the budget the pairs are not the budgeted ones: they run again, whole.
    cfg.budget.minutes = None
    meta = json.loads(run_stage(STAGES["acceptance"], tiny_run, cfg, {}, STAGES).read_text())
    assert meta["budget"]["seconds"] is None and meta["budget"]["skipped"] == []
    data = json.loads((tiny_run / "acceptance" / "bf16__ngram.json").read_text())
    assert data["direct_check_plan"]["stopped"] is None and data["direct_check_plan"]["prompts_skipped"] == []
    assert data["lossless"]["greedy_identical"] is True


def test_the_tie_tolerance_is_computed_once_per_target(tiny_model, monkeypatch):
    """It reads neither the draft nor the runs: a second pair with divergences reuses it."""
    from pipeline.speculation import lossless

    calls = []
    monkeypatch.setattr(lossless, "tie_tolerance", lambda m, s, w: calls.append(w) or {"tolerance": 0.5})
    samples = [([1, 2, 3], [4, 5, 6])]
    a = lossless.shared_tie_tolerance(tiny_model, samples, [1, 2, 3])
    a["tolerance"] = 9.0  # a caller's copy: the shared one is not changed
    assert lossless.shared_tie_tolerance(tiny_model, samples, [3, 2, 1, 1]) == {"tolerance": 0.5}
    assert len(calls) == 1
    lossless.shared_tie_tolerance(tiny_model, samples, [1, 2])  # other widths: another rule
    lossless.shared_tie_tolerance(tiny_model, [([1, 2], [4, 5, 6])], [1, 2, 3])  # other texts
    assert len(calls) == 3
