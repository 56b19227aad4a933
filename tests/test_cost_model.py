"""The run's cost model (pipeline/tools/estimate.py, issue 27): the step-time formula against a hand
computation, linear growth in repeats and items, budget caps, and the command line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.config import load_config
from pipeline.tools import cost_model as cm
from pipeline.tools import estimate as est
from pipeline.tools import estimate_quality as estq
from pipeline.tools import cost_devices as cd
from pipeline.tools.cost_devices import DEVICES, SLOWDOWN_GPU

REPO = Path(__file__).resolve().parent.parent
GPU, DEFAULT = REPO / "configs/gpu.yaml", REPO / "configs/default.yaml"


def with_section(cfg, section: str, **values):
    """A copy of `cfg` with `values` set in one of its sections (the rest as the file says)."""
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=values)})


@pytest.fixture(scope="module")
def gpu_cost():
    return cm.Cost(load_config(GPU), "8b", DEVICES["h100"])


def test_decode_step_is_the_roofline_bytes_over_bandwidth_by_hand(gpu_cost):
    """Llama-3-8B in bf16 on an H100, B = 1 at 1024 cached positions, written out from the datasheet
    and the model's config (exact arithmetic: tolerance 1e-9 relative, float rounding only)."""
    params = 8_030_261_504  # Llama-3-8B, every parameter
    embedding = 128256 * 4096  # untied input embedding: a step reads one row, not the matrix
    weights = (params - embedding) * 2  # bytes read per step, bf16
    kv = 1025 * 2 * 32 * 8 * 128 * 2  # (1024 cached + the new token) x K and V x layers x kv heads x dims x 2 B
    bandwidth = 3.35e12 * 0.70
    flops = 2 * (params - embedding) + 2 * 32 * 32 * 128 * (2 * 1024 + 1)  # matmuls + attention over 1025
    compiled = (weights + kv) / bandwidth + flops / (989e12 * 0.50)
    assert gpu_cost.decode_step("bf16", 1, 1024, eager=False) == pytest.approx(compiled, rel=1e-9)
    assert compiled == pytest.approx(6.49e-3, rel=1e-3)  # ms-scale sanity: ~15.1 GB at 2.35 TB/s
    # Eager: the host's launches for 32 layers on top.
    assert gpu_cost.decode_step("bf16", 1, 1024) == pytest.approx(compiled + 32 * 0.6e-3, rel=1e-9)
    # The bytes term is the roofline's own formula.
    from pipeline.latency.roofline import bytes_per_step
    assert bytes_per_step(weights, 1, 1025, 2 * 32 * 8 * 128 * 2) == weights + kv


def test_quantized_step_reads_its_scheme_bytes(gpu_cost):
    """W4A16 reads about a third of bf16's bytes (estimated_weight_bytes); its slowdown multiplies."""
    bf16 = gpu_cost.decode_step("bf16", 1, 128, eager=False)
    w4 = gpu_cost.decode_step("w4a16-gptq", 1, 128, eager=False)
    assert w4 < 0.6 * bf16
    assert w4 / SLOWDOWN_GPU["gptq"] < 0.4 * bf16


def test_prefill_is_flops_over_peak(gpu_cost):
    """8192 tokens in one call: 2 x matmul parameters x tokens + causal attention at 50% of 989 TFLOPS,
    plus one read of the weights and the new cache (tolerance 1e-9 relative); the flops are 97% of it."""
    matmul = 2 * (8_030_261_504 - 128256 * 4096) * 8192
    attention = 2 * 32 * 32 * 128 * 8192 * 8192
    flops_s = (matmul + attention) / (989e12 * 0.5)
    bytes_s = ((8_030_261_504 - 128256 * 4096) * 2 + 8192 * 131072) / (3.35e12 * 0.7)
    prefill = gpu_cost.forward("bf16", 1, 8192, 0, eager=False)
    assert prefill == pytest.approx(flops_s + bytes_s, rel=1e-9)
    assert flops_s / prefill > 0.97


def test_tokens_per_round_formula():
    assert cm.tokens_per_round(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert cm.tokens_per_round(4, 1.0) == 5.0
    # A batch keeps its fewest accepted: B = 4 rows at 0.5 each act as one at 0.5^4.
    assert cm.tokens_per_round(3, 0.5, batch=4) == pytest.approx(cm.tokens_per_round(3, 0.5 ** 4))


def _stage(doc: dict, name: str) -> dict:
    return next(r for r in doc["stages"] if r["stage"] == name)


def test_latency_grows_linearly_in_repeats():
    cfg, h100 = load_config(GPU), DEVICES["h100"]
    seconds = [est.latency(cm.Cost(with_section(cfg, "latency", repeats=r), "8b", h100)).seconds
               for r in (5, 10, 15)]
    assert seconds[1] - seconds[0] == pytest.approx(seconds[2] - seconds[1], rel=1e-9)
    assert seconds[1] > seconds[0]


def test_quality_grows_linearly_in_items():
    """One generated slice, one look: 80, 160, 240 items (whole batches of 40) add the same time."""
    cfg = with_section(load_config(DEFAULT), "quality", slices=["reasoning"], tasks=[], wave_items=None)
    seconds = [est.quality(cm.Cost(with_section(cfg, "quality", items_per_slice=n, max_items=n), "smollm2-135m",
                                    DEVICES["cpu-2core"])).seconds for n in (80, 160, 240)]
    assert seconds[1] - seconds[0] == pytest.approx(seconds[2] - seconds[1], rel=1e-9)
    assert seconds[1] > seconds[0]


def test_quality_first_look_is_the_first_wave_of_every_slice_and_task():
    c = cm.Cost(load_config(GPU), "8b", DEVICES["h100"])
    assert estq.quality_items(c, "long_context") == (999, 201)  # whole haystacks of 3; the first end >= 200
    assert estq.quality_items(c, "bfcl") == (762, 200)  # one item per cluster
    # HumanEval's 164 problems are under one wave of 200: gpu.yaml gives the slice waves of 82.
    assert estq.quality_items(c, "code") == (164, 82)
    # lm-eval tasks in waves too (issue 27): every document in a seeded order, capped at max_items.
    assert estq.quality_items(c, "gsm8k") == (1000, 200)
    assert estq.quality_items(c, "mmlu") == (1000, 200)
    assert estq.quality_items(c, "mgsm_direct") == (990, 209)  # task_clusters doc_id: 90 problems x 11 languages
    # The floor holds each task's first wave for every model, not the task whole.
    doc = est.estimate(load_config(GPU), "8b", DEVICES["h100"])
    ref = next(p for p in _stage(doc, "quality")["parts"] if p["what"].startswith("bf16: load, first look"))
    whole = sum(estq.slice_cost(c, "bf16", t, 1000) for t in ("gsm8k", "mmlu"))
    assert ref["seconds"] < whole


@pytest.mark.parametrize("pool, cluster, asked, wave", [
    (1000, 1, 1000, 200), (999, 3, 999, 200), (1000, 3, 1000, 200), (2750, 11, 1000, 200), (2750, 11, 200, 40),
    (240, 3, 240, 40), (40, 3, 40, None), (164, 1, 1000, 200), (1319, 1, None, 200)])
def test_waves_of_is_the_stages_selection_and_looks(pool, cluster, asked, wave):
    """waves_of against the stage's own functions on a pool of equal clusters (a short last one where
    they do not divide): pipeline/quality/waves.py order_items, then pipeline/gate/looks.py plan."""
    from pipeline.gate.looks import plan
    from pipeline.quality.waves import order_items

    blob = "".join(json.dumps({"id": f"i{i}", "cluster": f"c{i // cluster}", "prompt": f"q{i}"}) + "\n"
                   for i in range(pool)).encode()
    chosen, ends = order_items(blob, 0, "s", asked or pool)
    n = len(chosen.splitlines())
    sequential = bool(wave) and wave < (asked or pool)
    looks = plan(n, wave if sequential else None, ends if sequential else None)
    got_n, got_looks, per = estq.waves_of(pool, cluster, asked, wave)
    assert (got_n, got_looks) == (n, looks)
    assert per == n // len(ends)  # items a cluster holds in the selection


def test_generated_slices_are_planned_as_the_stage_plans_them():
    """The stage's own plan (pipeline/quality/plans.py: slice_data) for the generated slices of both
    configs, 1000 long-context items included (a short last haystack: one item per haystack)."""
    import yaml

    from pipeline.quality.plans import slice_data as _slice_data

    gpu = yaml.safe_load(GPU.read_text())
    gpu["quality"]["per_slice"]["long_context"] = {"items": 1000}
    (short,) = [load_config(GPU, {"quality": gpu["quality"]})]
    for cfg in (load_config(DEFAULT), load_config(GPU), short):
        c = cm.Cost(cfg, "tiny", DEVICES["h100"])
        for name in cfg.quality.slices:
            if name in ("bfcl", "code"):
                continue
            _, stage_plan = _slice_data(name, cfg.quality, cfg.seed, None)
            n, looks, _ = estq.quality_plan(c, name)
            assert (n, looks) == (stage_plan["n_max"], stage_plan["looks"]), name
    assert estq.quality_plan(cm.Cost(short, "tiny", DEVICES["h100"]), "long_context")[:2] == (334, [200, 334])


def test_a_slices_own_wave_items_plans_its_looks_in_the_stage_and_the_estimate():
    """quality.per_slice.<name>.wave_items: that slice's looks, in the stage's plan and the estimate's."""
    from pipeline.quality.plans import slice_data as _slice_data

    cfg = load_config(DEFAULT, {"quality": {"per_slice": {"reasoning": {"wave_items": 80}}}})
    assert cfg.quality.wave_items_for("reasoning") == 80 and cfg.quality.wave_items_for("language") == 40
    assert cfg.quality.per_slice["bfcl"].items == "all"  # the defaults still merge under it
    c = cm.Cost(cfg, "tiny", DEVICES["h100"])
    for name, looks in (("reasoning", [80, 160, 240]), ("language", [40, 80, 120, 160, 200, 240])):
        _, stage_plan = _slice_data(name, cfg.quality, cfg.seed, None)
        assert stage_plan["looks"] == looks, name
        assert estq.quality_plan(c, name)[:2] == (240, looks), name
    # The code slice on gpu.yaml: two looks of 82, so its first look is half the problems.
    gpu = cm.Cost(load_config(GPU), "8b", DEVICES["h100"])
    assert estq.quality_plan(gpu, "code")[:2] == (164, [82, 164])


def test_a_warm_up_is_short_runs_not_a_repeat():
    """Since 2026-12-02 (pipeline/latency/speculative.py WARMUP_UNIT, pipeline/latency/batched.py) a
    B = 1 pair warms up on one run of min(new_tokens, 8) tokens per temperature and k (plain included)
    on the shortest prompt, a batched pair on every cell once at that length; a plain grid cell still
    on whole runs. Each warm-up adds exactly that to the pair's part (hand sum, 1e-9 relative)."""
    cfg = load_config(GPU)
    h100 = DEVICES["h100"]

    def parts(warmup: int) -> dict:
        c = cm.Cost(with_section(cfg, "latency", warmup=warmup), "8b", h100)
        return {w: s for w, s, _ in est.latency(c).parts}, c

    (p0, c), (p2, _) = parts(0), parts(2)
    lat, ks = cfg.latency, range(1, (cfg.latency.k_max or cfg.vllm.k_max or cfg.acceptance.k_max) + 1)
    temps, new = len(cfg.acceptance.temperatures), min(lat.new_tokens, 8)
    shortest = min(cm.prompt_lengths(c, "latency", lat.speculative_prompts_per_kind or None))
    one = temps * (c.generate("bf16", 1, shortest, new, eager=False)
                   + sum(c.speculate("bf16", "ngram", 1, shortest, new, k, False) for k in ks))
    key = next(w for w in p0 if w.startswith("bf16 + ngram: B = 1"))
    assert p2[key] - p0[key] == pytest.approx(2 * one, rel=1e-9)
    row = min(cm.prompt_lengths(c, "latency", 1))
    cells = sum(c.generate("bf16", b, row, new, eager=False)
                + sum(c.speculate("bf16", "ngram", b, row, new, k, False) for k in ks) for b in lat.spec_batch_sizes)
    key = next(w for w in p0 if w.startswith("bf16 + ngram: batched"))
    assert p2[key] - p0[key] == pytest.approx(2 * cells, rel=1e-9)
    # A plain grid cell: whole runs of new_tokens (pipeline/latency/grid.py), a repeat's time each.
    key = next(w for w in p0 if w.startswith("bf16: grid of"))
    assert p2[key] - p0[key] == pytest.approx(2 * p0["bf16: grid repeats 2-10"] / (lat.repeats - 1), rel=1e-9)


def test_latency_floor_holds_each_pairs_first_repeat_and_every_compile():
    """The latency stage (pipeline/stages/latency.py) compiles its graphs and times every pair the
    screen keeps once, warm-up included, whatever the budget; only later repeats and closed-loop
    waves are skipped. Measured on 2026-12-02 (configs/release-check.yaml, 6-minute share): the
    stage spent 17 min, its floor; the estimate then put its floor under 6 min, pairs not in it.
    So each pair's floor part is its probe + warm-up + one repeat, and the rest is repeats - 1 of
    that one repeat (exact: 1e-9 relative)."""
    cfg = load_config(GPU)
    c = cm.Cost(cfg, "8b", DEVICES["h100"])
    lat, ks = cfg.latency, range(1, (cfg.latency.k_max or cfg.vllm.k_max or cfg.acceptance.k_max) + 1)
    parts = {w: (s, f) for w, s, f in est.latency(c).parts}
    temps = len(cfg.acceptance.temperatures)
    lengths = cm.prompt_lengths(c, "latency", lat.speculative_prompts_per_kind or None)
    one = temps * sum(c.generate("bf16", 1, p, lat.new_tokens, eager=False)
                      + sum(c.speculate("bf16", "ngram", 1, p, lat.new_tokens, k, False) for k in ks)
                      for p in lengths)
    shortest, new = min(lengths), min(lat.new_tokens, 8)
    warm = lat.warmup * temps * (c.generate("bf16", 1, shortest, new, eager=False)
                                 + sum(c.speculate("bf16", "ngram", 1, shortest, new, k, False) for k in ks))
    # The floor: the warm-up and the two repeats a k is recommended from (MIN_TIMING_REPEATS).
    first, later = parts["bf16 + ngram: B = 1 warm-up + 2 repeats"], parts["bf16 + ngram: B = 1 repeats 3-10"]
    assert first[1] and not later[1]
    assert first[0] == pytest.approx(warm + 2 * one, rel=1e-9)  # prompt lookup: no probe
    assert later[0] == pytest.approx((lat.repeats - 2) * one, rel=1e-9)
    # Every compile is in the floor: grids, the B = 1 session and the batched session.
    compile_parts = [w for w in parts if "compile" in w and "compile 0 graphs" not in w]
    assert compile_parts and all(parts[w][1] for w in compile_parts)


def test_batched_floor_holds_the_waves_that_come_with_the_first_two_repeats():
    """pipeline/latency/batched.py runs closed-loop waves r, r + R, ... right after repeat r (R =
    latency.repeats); repeats 0 and 1 (MIN_TIMING_REPEATS) run whatever the budget, so their waves
    do; the rest follow later repeats or the budget. On the default config (R = 5, 6 waves) that is
    3 waves per B in the floor (0, 5, 1) and 3 outside it (exact sums, 1e-9 relative; the CPU runs
    eagerly and compiles nothing)."""
    cfg = load_config(DEFAULT)
    c = cm.Cost(cfg, "smollm2-135m", DEVICES["cpu-2core"])
    lat, ks = cfg.latency, range(1, (cfg.latency.k_max or cfg.vllm.k_max or cfg.acceptance.k_max) + 1)
    parts = {w: (s, f) for w, s, f in est.latency(c).parts}
    row = min(cm.prompt_lengths(c, "latency", 1))
    sizes, loops, new = sorted(set(lat.spec_batch_sizes)), lat.closed_loop_batch_sizes, min(lat.new_tokens, 8)

    def cells(n):
        return sum(c.generate("bf16", b, row, n) + sum(c.speculate("bf16", "ngram", b, row, n, k) for k in ks)
                   for b in sizes)
    t = lat.closed_loop_tokens
    wave = sum(c.generate("bf16", b, row, t) + min(c.speculate("bf16", "ngram", b, row, t, k) for k in ks)
               for b in loops)
    assert (lat.repeats, lat.closed_loop_waves) == (5, 6)
    first = parts["bf16 + ngram: batched: compile 0 graphs, warm-up + 2 repeats, 3 closed-loop wave(s)"]
    rest = parts["bf16 + ngram: batched: repeats 3-5, the other closed-loop waves"]
    assert first == (pytest.approx(lat.warmup * cells(new) + 2 * cells(lat.new_tokens) + 3 * wave, rel=1e-9), True)
    assert rest == (pytest.approx(3 * cells(lat.new_tokens) + 3 * wave, rel=1e-9), False)


def test_batched_target_graphs_compile_once_per_target():
    """The batched phase has one compile session per target (pipeline/stages/latency.py): adding
    a model draft adds its own widths 1 and 2 at each batch size, not the target's graphs again."""
    cfg = load_config(GPU)
    h100 = DEVICES["h100"]

    def latency_parts(drafts):
        c = cm.Cost(cfg.model_copy(update={"drafts": drafts}), "8b", h100)
        return {w: s for w, s, _ in est.latency(c).parts}, c

    one, c = latency_parts(["ngram"])
    two, _ = latency_parts(["ngram", "layerskip:8"])
    key = next(w for w in one if w.startswith("bf16: batched pairs: load, compile the target's"))
    sizes = set(cfg.latency.spec_batch_sizes) | set(cfg.latency.closed_loop_batch_sizes)
    graphs = int(key.split("target's ")[1].split()[0])
    k_max = cfg.latency.k_max or cfg.acceptance.k_max
    # The decode step and one graph for the verify widths 2..k_max+1 at each B (dynamic widths, the
    # default), whose other k_max - 1 widths each record a CUDA graph; a graph per width when static.
    assert graphs == len(sizes) * 2
    verify = cd.DYNAMIC_COMPILE_FACTOR * h100.compile_s + (k_max - 1) * h100.record_s
    assert one[key] == pytest.approx(c.load("bf16") + len(sizes) * (h100.compile_s + verify))
    static_cfg = with_section(cfg.model_copy(update={"drafts": ["ngram"]}), "latency", compile_dynamic_width=False)
    static = {w: s for w, s, _ in est.latency(cm.Cost(static_cfg, "8b", h100)).parts}
    key = next(w for w in static if w.startswith("bf16: batched pairs: load, compile the target's"))
    assert int(key.split("target's ")[1].split()[0]) == len(sizes) * (1 + k_max)
    draft = next(w for w in two if w.startswith("bf16 + layerskip:8: batched: compile"))
    assert f"compile {2 * len(sizes)} graphs" in draft
    assert next(w for w in one if w.startswith("bf16 + ngram: batched: compile")).startswith(
        "bf16 + ngram: batched: compile 0 graphs")


def test_screen_is_predicted_only_as_the_stage_screens():
    """The stage screens model drafts where the steps run eagerly (the CPU), not where they compile
    with inductor (gpu.yaml on an H100). On the CPU the estimate predicts a pair screened out when the
    screen's bound, at the guessed rate + SCREEN_RATE_MARGIN, is below 1 at every k; such a pair costs
    its probe only. The bound by hand at k = 1 (1e-9 relative)."""
    cpu = cm.Cost(load_config(DEFAULT), "smollm2-135m", DEVICES["cpu-2core"])
    spec, ctx = "self:w4a16-gptq", 300.0
    rate = cm.ACCEPTANCE_RATE["self"] + cm.SCREEN_RATE_MARGIN
    k1 = (1 + rate) * cpu.decode_step("bf16", 1, ctx) / (cpu.forward("bf16", 1, 2, ctx)
                                                         + cpu.draft(spec, "bf16", 1, 1, ctx))
    assert cpu.screen_bound("bf16", spec, 1, ctx, [1]) == pytest.approx(k1, rel=1e-9)
    assert cpu.screen_bound("bf16", spec, 1, ctx, [1, 2, 3]) >= k1 * (1 - 1e-12)  # the largest over k
    parts = {w: (t, f) for w, t, f in est.latency(cpu).parts}
    probes = [w for w in parts if "predicted screened out" in w]
    assert any(w.startswith("bf16 + self:w4a16-gptq: B = 1 probe") for w in probes)
    for w in probes:
        assert parts[w] == (cm.SCREEN_PROBE_S, True)
    assert not any(w.startswith("bf16 + self:w4a16-gptq") and "repeat" in w for w in parts)  # not timed
    assert not any(w.startswith("bf16 + ngram") and "probe" in w for w in parts)  # prompt lookup: never screened
    gpu = cm.Cost(load_config(GPU), "8b", DEVICES["h100"])
    assert not any("predicted screened out" in w for w, _, _ in est.latency(gpu).parts)
    # Inductor asked for on the CPU: the stage does not screen there either (plan.why_not_screened).
    inductor = with_section(load_config(DEFAULT), "latency", compile=True, compile_backend="inductor")
    assert not any("predicted screened out" in w
                   for w, _, _ in est.latency(cm.Cost(inductor, "smollm2-135m", DEVICES["cpu-2core"])).parts)


def test_budget_caps_each_planning_stage_at_its_share():
    cfg = with_section(load_config(DEFAULT), "budget", minutes=60.0)
    doc = est.estimate(cfg, "smollm2-135m", DEVICES["cpu-2core"])
    for name, share in cfg.budget.shares.items():
        if name == "vllm":  # the cost model has no vllm stage: it plans specq's own engine
            continue
        row = _stage(doc, name)
        assert row["cap_s"] == pytest.approx(60 * 60 * share)
        assert row["floor_s"] <= row["cap_s"], name  # this config's floors fit, so the cap binds
        assert row["budgeted_s"] == pytest.approx(min(row["exhaustive_s"], row["cap_s"]), abs=0.1)
        assert row["budgeted_s"] <= row["cap_s"] + 0.1
    for name in ("prepare", "quantize", "drafts", "marginal", "gate", "report"):
        row = _stage(doc, name)
        assert row["cap_s"] is None and row["budgeted_s"] == row["exhaustive_s"]
    assert doc["total"]["budgeted_s"] < doc["total"]["exhaustive_s"]


def test_a_floor_over_the_share_is_kept_and_said():
    """A stage cannot go below what it does whatever the budget (quality: every first look)."""
    cfg = with_section(load_config(DEFAULT), "budget", minutes=5.0)
    row = _stage(est.estimate(cfg, "smollm2-135m", DEVICES["cpu-2core"]), "quality")
    assert row["floor_s"] > row["cap_s"]
    assert row["budgeted_s"] == pytest.approx(row["floor_s"], abs=0.1)
    assert any("over its share" in n for n in row["notes"])


def _stage_lines(out: str) -> dict[str, int]:
    words = [line.split()[0] for line in out.splitlines() if line.strip()]
    return {name: words.count(name) for name in (*est.STAGES, "total")}


def test_cli_on_gpu_yaml_prints_a_line_per_stage_and_a_total(tmp_path):
    out = tmp_path / "estimate.json"
    res = subprocess.run([sys.executable, "-m", "pipeline.tools.estimate", "--config", str(GPU), "--shape", "8b",
                          "--device", "h100", "--minutes", "120", "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert set(_stage_lines(res.stdout).values()) == {1}, res.stdout
    assert "budget: 120 min" in res.stdout
    doc = json.loads(out.read_text())
    assert [r["stage"] for r in doc["stages"]] == list(est.STAGES)
    assert doc["total"]["exhaustive_s"] == pytest.approx(sum(r["exhaustive_s"] for r in doc["stages"]), abs=1)


def test_cli_on_default_yaml_for_the_cpu(capsys):
    assert est.main(["--config", str(DEFAULT), "--shape", "smollm2-135m", "--device", "cpu-2core"]) == 0
    out = capsys.readouterr().out
    assert set(_stage_lines(out).values()) == {1}, out


def test_bad_device_is_one_line_and_exit_2():
    res = subprocess.run([sys.executable, "-m", "pipeline.tools.estimate", "--config", str(GPU), "--device", "tpu-v9"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["estimate: unknown --device 'tpu-v9' (known: h100, h200, a100-80gb, "
                                               "cpu-2core, here)"]
    assert res.stdout == ""


def test_bad_shape_or_minutes_is_one_line_and_exit_2(capsys):
    assert est.main(["--config", str(GPU), "--shape", "70b"]) == 2
    assert est.main(["--config", str(GPU), "--minutes", "0"]) == 2
    assert est.main(["--config", str(REPO / "configs/none.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "70b" in err[0] and "--minutes" in err[1] and "none.yaml" in err[2]


# ---------------------------------------------------------------- --device here (pipeline/tools/cost_here.py)

def _cpu_2core_timings(scale: float = 1.0) -> dict:
    """The figures cpu-2core was built from (85 ms a float32 step, TOKEN_COST a prefill row-token), x scale."""
    from pipeline.quality.calibration import TOKEN_COST
    from pipeline.tools.cost_devices import CPU_FP32_STEP_S, SMOLLM2_FP32_BYTES
    params = SMOLLM2_FP32_BYTES // 4
    return {"step_s": CPU_FP32_STEP_S * scale, "token_s": TOKEN_COST * scale, "params": params,
            "fp32_bytes": SMOLLM2_FP32_BYTES, "threads": 2, "cpus": 2}


def test_here_from_cpu_2core_figures_is_cpu_2core():
    """Fed the timings cpu-2core was built from, the measured profile gives the same estimate, stage by stage."""
    from pipeline.tools.cost_here import device_from
    cfg = load_config(DEFAULT)
    want = est.estimate(cfg, "smollm2-135m", DEVICES["cpu-2core"])
    got = est.estimate(cfg, "smollm2-135m", device_from(_cpu_2core_timings()))
    for a, b in zip(want["stages"], got["stages"]):
        assert b["exhaustive_s"] == pytest.approx(a["exhaustive_s"], rel=1e-6, abs=0.1), a["stage"]


def test_here_twice_as_slow_doubles_every_forward_and_gptq():
    """Forwards are bytes / bandwidth + FLOPs / FLOP/s on a CPU (no launch term): both halve, so every forward
    and GPTQ take exactly twice as long; disk and start-up do not change."""
    from pipeline.tools.cost_here import device_from
    cfg = load_config(DEFAULT)
    one, two = (cm.Cost(cfg, "smollm2-135m", device_from(_cpu_2core_timings(x))) for x in (1.0, 2.0))
    for args in [("w4a16-gptq", 1, 1, 500), ("bf16", 8, 300, 0), ("int8", 4, 1, 2000)]:
        assert two.forward(*args) == pytest.approx(2 * one.forward(*args), rel=1e-9)
    assert two.dev.gptq_s_per_param == pytest.approx(2 * one.dev.gptq_s_per_param, rel=1e-9)
    assert (two.dev.disk, two.dev.start_s) == (one.dev.disk, one.dev.start_s)


def test_timings_on_a_tiny_model_are_positive_and_recorded(capsys):
    """The CLI times the shape's model here and records the figures it used in the JSON."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert est.main(["--config", str(DEFAULT), "--shape", "tiny", "--device", "here"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "device here (this CPU, measured (1 threads))" in out
    assert "measured here: a float32 decode step" in out
    assert set(_stage_lines(out).values()) == {1}, out


def test_measure_builds_the_profile_from_its_timings():
    from pipeline.tools.cost_here import measure
    device, t = measure(cm.SHAPES["tiny"], reps=1)
    assert t["step_s"] > 0 and t["token_s"] > 0 and t["params"] > 0
    assert device.bandwidth == pytest.approx(t["fp32_bytes"] / t["step_s"])
    assert device.flops == pytest.approx(2 * t["params"] / t["token_s"])
    assert not device.cuda and device.name == "here"


def test_the_estimate_times_a_pair_at_the_k_the_stage_would():
    """The estimate's form of the stage's cut (pipeline/latency/screen.py: ks_to_time) on predicted
    bounds: 1..k_hi where some batch size's bound reaches 1 at k_hi; every k when no bound is
    predicted (prompt lookup, compiled runs) or none reaches 1 (the pair is predicted screened)."""
    from pipeline.latency.screen import timed_prefix  # the estimate calls the stage's own cut

    ks = [1, 2, 3, 4]
    assert timed_prefix(ks, [{1: 1.05, 2: 1.01, 3: 0.97, 4: 0.9}]) == [1, 2]
    assert timed_prefix(ks, [{1: 1.1, 2: 0.9, 3: 0.8, 4: 0.7}, {1: 0.8, 2: 0.7, 3: 1.02, 4: 0.6}]) == [1, 2, 3]
    assert timed_prefix(ks, [{1: 0.9, 2: 0.8, 3: 0.7, 4: 0.6}]) == ks
    assert timed_prefix(ks, []) == ks
