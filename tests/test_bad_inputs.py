"""Bad inputs that used to crash with a traceback (issue 12): 0/n and n/n acceptance in the
marginal plot, latency.k_max 0, truncated weight files as MODEL, as a variant and as a draft.
Each must end the stage with one line on stderr and exit 2.

    .venv/bin/python -m pytest -q tests/test_bad_inputs.py
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from statsmodels.stats.proportion import proportion_confint

from conftest import make_tiny_tokenizer, save_as_prepared
from pipeline.__main__ import main

REPO = Path(__file__).resolve().parent.parent


def _truncate(path: Path, keep: float = 0.5) -> None:
    """Replace `path` by its first `keep` share of bytes (a new inode: hard links elsewhere keep
    the whole file)."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[: int(len(data) * keep)])


def _one_line(capsys) -> str:
    """The error, one line and the last on stderr; before it only progress output (the stages'
    timestamped lines, transformers' loading bars), never a traceback."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines and lines[-1].startswith("specq: "), err[-3000:]
    assert sum(line.startswith("specq: ") for line in lines) == 1, lines
    return lines[-1]


# ---------------------------------------------------------------- acceptance CIs and the marginal plot


def _slice_with_constant_acceptance(a: float, n_tokens: int, k_max: int, prompts: int = 1) -> dict:
    """The acceptance stage's slice summary for texts whose every draft token is accepted with
    probability a (1.0: all accepted, 0.0: none) -- the 0/n and n/n cases."""
    from pipeline.speculation.acceptance_stats import prompt_record, summarize_slice
    from pipeline.speculation.expected_rounds import TextAcceptance, model_draft_rows, round_chain

    recs = []
    for i in range(prompts):
        rows = model_draft_rows(np.full(n_tokens - 1, a), k_max)
        text = TextAcceptance(rows, rows, np.full(n_tokens - 1, k_max), n_tokens, n_tokens + k_max + 1)
        recs.append(prompt_record(f"p{i}", "code", text, {k: round_chain(text, k) for k in range(1, k_max + 1)}))
    return summarize_slice(recs, k_max)


def test_wilson_bounds_hold_the_point_at_0_of_n_and_n_of_n():
    raw_misses = 0
    for n in range(1, 301):
        lo, hi = proportion_confint(n, n, alpha=0.05, method="wilson")
        raw_misses += hi < 1.0
    for n in (2, 3, 7, 40, 81, 160):
        for a, prompts in ((1.0, 1), (0.0, 1), (1.0, 3), (0.0, 3)):
            for pos in _slice_with_constant_acceptance(a, n, 2, prompts)["per_position"]:
                if pos["conditional"] is None:
                    continue
                lo, hi = pos["ci"]
                assert 0.0 <= lo <= pos["conditional"] <= hi <= 1.0, (n, a, pos)
    # The rounding the clip removes is real: statsmodels' n/n upper bound is below 1 for many n
    # (96 of 1..300 with statsmodels 0.14 when the issue was filed).
    assert raw_misses > 0


def test_marginal_plot_draws_all_and_none_accepted(tmp_path):
    from pipeline.serving.marginal import pair_report
    from pipeline.report.marginal import write_plot
    from tests.test_marginal import _latency

    all_in = _slice_with_constant_acceptance(1.0, 80, 3, prompts=2)
    none_in = _slice_with_constant_acceptance(0.0, 76, 3, prompts=2)
    for per in (all_in, none_in):
        acc = {"variant": "bf16", "draft": "ngram", "k_max": 3, "slices": {"all": {"0.0": per, "0.7": per}}}
        rep = pair_report(acc, _latency(3))
        write_plot(rep, tmp_path / "p.png")
        assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    # An artifact written before the clip (bounds a rounding error inside the point) still plots.
    rep["acceptance_per_position"] = [{"position": 1, "conditional": 1.0, "prefix": 1.0, "expected_beta": 0.9,
                                       "n": 80, "ci": [0.954, 0.9999999999999999]},
                                      {"position": 2, "conditional": 0.0, "prefix": 0.0, "expected_beta": 0.1,
                                       "n": 76, "ci": [3.5e-18, 0.048]}]
    write_plot(rep, tmp_path / "q.png")
    assert (tmp_path / "q.png").is_file()


# ---------------------------------------------------------------- config


def test_latency_k_max_zero_fails_validation(tmp_path, capsys):
    from pipeline.core.config import ConfigError, load_config

    for bad in (0, -2):
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(yaml.safe_dump({"latency": {"k_max": bad}}))
        with pytest.raises(ConfigError, match="latency.k_max"):
            load_config(cfg)
        assert main(["config", "--config", str(cfg)]) == 2
        assert "latency.k_max" in _one_line(capsys)
    cfg.write_text(yaml.safe_dump({"latency": {"k_max": 2}}))
    assert load_config(cfg).latency.k_max == 2
    cfg.write_text(yaml.safe_dump({"latency": {"k_max": None}}))
    assert load_config(cfg).latency.k_max is None


# ---------------------------------------------------------------- truncated weight files


def test_truncated_safetensors_as_model_is_one_line(tmp_path, tiny_model_dir, capsys):
    src = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, src)
    whole = (tiny_model_dir / "model.safetensors").read_bytes()
    for case, cut in (("data cut short", len(whole) // 2), ("header cut short", 40)):
        (src / "model.safetensors").unlink()
        (src / "model.safetensors").write_bytes(whole[:cut])
        run = tmp_path / f"run{cut}"
        rc = main(["prepare", "--run", str(run), "--config", str(REPO / "configs/smoke.yaml"), "--model", str(src)])
        line = _one_line(capsys)
        assert rc == 2 and "model.safetensors" in line and "truncated or corrupt" in line, (case, line)
        assert not run.exists()


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, tiny_model_dir):
    """A run with the tiny Llama's ref and a noised copy quantized, and the ngram draft made."""
    root = tmp_path_factory.mktemp("bad")
    run = root / "run"
    shutil.copytree(tiny_model_dir, run / "model")
    cfg = root / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "device": "cpu", "drafts": ["ngram"],
        "quantize": {"reference": "ref", "sanity_tokens": 32,
                     "variants": {"ref": {"scheme": "none"}, "noisy": {"scheme": "none", "weight_noise": 0.1}}},
        "acceptance": {"targets": ["noisy"], "k_max": 2, "max_new_tokens": 4, "prompts_per_kind": 1,
                       "lossless_samples": 4}}))
    assert main(["quantize", "--run", str(run), "--config", str(cfg)]) == 0
    assert main(["drafts", "--run", str(run), "--config", str(cfg)]) == 0
    return root, run, cfg


def test_truncated_variant_weights_are_one_line(small_run, capsys):
    root, run, cfg = small_run
    weights = run / "variants" / "noisy" / "model.safetensors"
    good = weights.read_bytes()
    try:
        _truncate(weights)
        capsys.readouterr()
        assert main(["acceptance", "--run", str(run), "--config", str(cfg)]) == 2
        line = _one_line(capsys)
        assert "corrupt artifact" in line and str(weights) in line, line
        assert not list((run / "acceptance").glob("*.json"))
        # The same variant as a self-draft: the draft builder goes through load_variant too.
        assert main(["drafts", "--run", str(run), "--config", str(cfg), "--drafts", "self:noisy"]) == 2
        assert "truncated or corrupt" in _one_line(capsys)
    finally:
        weights.unlink()
        weights.write_bytes(good)


def test_truncated_hf_draft_is_one_line(small_run, tiny_model, capsys):
    root, run, cfg = small_run
    draft_dir = root / "draft"
    save_as_prepared(tiny_model, make_tiny_tokenizer(), draft_dir)
    _truncate(draft_dir / "model.safetensors")
    capsys.readouterr()
    assert main(["drafts", "--run", str(run), "--config", str(cfg), "--drafts", f"hf:{draft_dir}"]) == 2
    line = _one_line(capsys)
    assert f"draft hf:{draft_dir}" in line and "truncated or corrupt" in line, line
    assert not (run / "drafts" / "meta.json").exists()


# ---------------------------------------------------------------- unknown quality tasks (issue 26)


def test_unknown_quality_task_is_refused_before_any_work(tmp_path, capsys):
    """`quality.tasks: [no_such_task_xyz]` used to be accepted; the quality stage then skipped it
    with a line and the gate never knew. Now `prepare` (the first stage of `make evaluate`)
    refuses it in one line, exit 2, before creating anything; so does the quality stage itself."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"quality": {"tasks": ["no_such_task_xyz"]}}))
    run = tmp_path / "run"
    assert main(["prepare", "--run", str(run), "--config", str(cfg), "--model", str(tmp_path / "nope")]) == 2
    line = _one_line(capsys)
    assert "quality.tasks" in line and "no_such_task_xyz" in line and "lm-eval knows" in line, line
    assert not run.exists()
    from pipeline.core.config import load_config
    from pipeline.core.stage import StageError
    from pipeline.stages.quality import precheck

    with pytest.raises(StageError, match="no_such_task_xyz"):
        precheck(load_config(cfg), {})
    # A YAML path that defines no task is refused too.
    with pytest.raises(StageError, match="nope.yaml"):
        precheck(load_config(cfg, {"quality": {"tasks": [str(tmp_path / "nope.yaml")]}}), {})
    precheck(load_config(cfg, {"quality": {"tasks": [], "slices": ["reasoning"]}}), {})
    with pytest.raises(StageError, match="unknown quality slice 'nope'"):
        precheck(load_config(cfg, {"quality": {"slices": ["nope"]}}), {})
