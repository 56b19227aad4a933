"""The foundation: config schema, stage plumbing (hashing, no-op, atomicity), prepare, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.__main__ import STAGES, main, slug
from pipeline.core.config import Config, ConfigError, load_config
from pipeline.core.stage import SCHEMA_VERSION, StageError, StageSpec, atomic_dir, run_stage

REPO = Path(__file__).resolve().parent.parent
CALLS: list[str] = []


# ---------------------------------------------------------------- config


def test_default_yaml_restates_schema_defaults():
    # configs/default.yaml lists the defaults users edit; it must not drift from the schema.
    assert load_config(REPO / "configs/default.yaml") == Config()


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_validate(name):
    load_config(REPO / "configs" / name)


def test_damaged_config_is_the_default_plus_one_noisy_variant():
    damaged, default = load_config(REPO / "configs/damaged.yaml"), Config()
    noisy = damaged.quantize.variants.pop("noisy")
    assert noisy.weight_noise > 0 and noisy.release and noisy.scheme == "none"
    assert damaged == default


def test_release_check_config_gates_with_the_default_quality_settings():
    # Issue 26's "on the default config": the same slices, waves, margin and budget minutes; the
    # candidates are an identical copy and a planted-damage copy.
    check, default = load_config(REPO / "configs/release-check.yaml"), Config()
    assert check.quality == default.quality and check.gate == default.gate
    assert check.budget.minutes == default.budget.minutes and check.quantize.reference == default.quantize.reference
    copy, noisy = check.quantize.variants["copy"], check.quantize.variants["noisy"]
    assert copy.scheme == "none" and copy.weight_noise == 0 and copy.release
    assert noisy.scheme == "none" and noisy.weight_noise > 0 and noisy.release


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("acceptance:\n  k_maxx: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'acceptance.k_maxx'"):
        load_config(p)


def test_a_key_no_longer_read_loads_with_one_warning_line_each(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("gate:\n  min_clusters: 5\n  confidence: 0.95\nmarginal:\n  confidence: 0.9\n"
                 "quantize:\n  calibration: {batch_size: 2}\n")
    assert load_config(p) == Config()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4
    assert "gate.min_clusters is no longer read and is ignored: clusters are always honoured" in err[2]
    # A stage's own confidence: the top-level one is read, and a value that differs from it says so.
    assert err[0].endswith("marginal.confidence is no longer read; set the top-level confidence (0.95 now, not 0.9)")
    assert "gate.confidence is no longer read and is ignored" in err[1]
    assert "quantize.calibration.batch_size is no longer read" in err[3]
    p.write_text("confidence: 0.9\nquality: {confidence: 0.9}\n")
    assert load_config(p).confidence == 0.9
    assert "quality.confidence is no longer read and is ignored" in capsys.readouterr().err
    # Keys that were never in the schema are still refused, a removed section's too.
    for text, key in (("gate:\n  min_clusterz: 5\n", "gate.min_clusterz"), ("marginal:\n  k: 1\n", "marginal")):
        p.write_text(text)
        with pytest.raises(ConfigError, match=rf"unknown config key '{key}'"):
            load_config(p)


def test_no_key_no_longer_read_is_in_the_schema():
    from pipeline.core.config import DEPRECATED

    for key in DEPRECATED:
        model, *parents, leaf = [Config, *key.split(".")]
        for name in parents:
            model = model.model_fields[name].annotation if name in model.model_fields else None
            if model is None:
                break
        assert model is None or leaf not in model.model_fields, key


def test_bad_value_and_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("acceptance:\n  k_max: 0\n")
    with pytest.raises(ConfigError, match="acceptance.k_max"):
        load_config(p)
    p.write_text("acceptance: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    p.write_text("quantize:\n  reference: nope\n")
    with pytest.raises(ConfigError, match="quantize.reference 'nope'"):
        load_config(p)


def test_cli_bad_config_is_one_line_exit_2(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("bogus: 1\n")
    run = tmp_path / "run"
    assert main(["prepare", "--config", str(p), "--run", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown config key 'bogus'" in err[0]
    assert not run.exists()


def test_slug_matches_makefile_rule():
    assert slug("smollm2-135m") == "smollm2-135m"
    assert slug("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert slug("/models/My Model/") == "my-model"


# ---------------------------------------------------------------- stage plumbing


def stage_a(ctx):
    CALLS.append("a")
    (ctx.out_dir / "a.txt").write_text(str(ctx.config.acceptance.k_max))


def stage_b(ctx):
    CALLS.append("b")
    (ctx.out_dir / "b.txt").write_text(str(ctx.config.gate.margin))


def stage_c(ctx):
    CALLS.append("c")
    for v in ("x", "y"):
        item = ctx.item(v, {"margin": ctx.config.gate.margin, "v": v})
        if item.fresh:
            continue
        with item.writing() as tmp:
            (tmp / "out.txt").write_text(v)
            if v == "y" and ctx.args.get("crash"):
                raise RuntimeError("boom")
        CALLS.append(f"c:{v}")


def stage_fail(ctx):
    raise StageError("bad input here")


SPECS = {
    "a": StageSpec("a", ["acceptance"], [], "a", [], "test_foundation:stage_a"),
    "b": StageSpec("b", ["gate"], ["a"], "b", [], "test_foundation:stage_b"),
    "c": StageSpec("c", ["gate"], ["a"], "c", [], "test_foundation:stage_c"),
    "fail": StageSpec("fail", [], [], "f", [], "test_foundation:stage_fail"),
    "d": StageSpec("d", ["gate"], [], "d", [], "test_foundation:stage_b", after=["a"]),
}


def _run_all(run, cfg, **args):
    for name in ("a", "b", "c"):
        run_stage(SPECS[name], run, cfg, args if name == "c" else {}, SPECS)


def test_stage_noop_and_exact_reruns(tmp_path):
    CALLS.clear()
    cfg = Config()
    _run_all(tmp_path, cfg)
    assert CALLS == ["a", "b", "c", "c:x", "c:y"]
    CALLS.clear()
    _run_all(tmp_path, cfg)  # nothing changed: nothing runs
    assert CALLS == []
    # gate.margin is read by b and c only: a stays as it is.
    cfg2 = Config.model_validate({"gate": {"margin": 0.1}})
    _run_all(tmp_path, cfg2)
    assert CALLS == ["b", "c", "c:x", "c:y"]
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert meta["config"]["gate"]["margin"] == 0.1 and meta["libraries"]["torch"]
    # acceptance is read by a; b and c read a's output, so all three re-run.
    CALLS.clear()
    _run_all(tmp_path, Config.model_validate({"gate": {"margin": 0.1}, "acceptance": {"k_max": 2}}))
    assert CALLS == ["a", "b", "c"]  # c's items depend on the margin only: both reused


def test_crash_mid_stage_keeps_finished_items_only(tmp_path):
    CALLS.clear()
    cfg = Config()
    run_stage(SPECS["a"], tmp_path, cfg, {}, SPECS)
    with pytest.raises(RuntimeError):
        run_stage(SPECS["c"], tmp_path, cfg, {"crash": True}, SPECS)
    assert (tmp_path / "c" / "x" / "meta.json").exists()
    assert not (tmp_path / "c" / "y").exists() and not (tmp_path / "c" / "y.tmp").exists()
    assert not (tmp_path / "c" / "meta.json").exists()  # the stage does not look finished
    CALLS.clear()
    run_stage(SPECS["c"], tmp_path, cfg, {"crash": False}, SPECS)
    assert CALLS == ["c", "c:y"]  # resumed: x was reused


def _set_schema(path: Path, schema) -> None:
    meta = json.loads(path.read_text())
    assert meta["schema"] == SCHEMA_VERSION
    meta.pop("schema")
    path.write_text(json.dumps(meta if schema is None else {**meta, "schema": schema}))


def test_artifacts_of_another_schema_re_run_with_their_items(tmp_path, capsys):
    """A stage whose meta.json carries another schema version (or none) is not fresh: it re-runs,
    saying so in one line, and none of its items is reused. An item of another schema is never
    fresh either (here the stage was interrupted, so only the item says it)."""
    CALLS.clear()
    cfg = Config()
    _run_all(tmp_path, cfg)
    for path in (tmp_path / "c" / "meta.json", tmp_path / "c" / "x" / "meta.json", tmp_path / "c" / "y" / "meta.json"):
        _set_schema(path, None)
    CALLS.clear()
    capsys.readouterr()
    _run_all(tmp_path, cfg)
    assert CALLS == ["c", "c:x", "c:y"]  # a and b are of this schema: up to date
    err = capsys.readouterr().err
    assert f"c: artifacts from another specq version (schema none, this is {SCHEMA_VERSION}): re-running" in err
    assert json.loads((tmp_path / "c" / "meta.json").read_text())["schema"] == SCHEMA_VERSION
    (tmp_path / "c" / "meta.json").unlink()
    _set_schema(tmp_path / "c" / "x" / "meta.json", SCHEMA_VERSION + 1)
    CALLS.clear()
    _run_all(tmp_path, cfg)
    assert CALLS == ["c", "c:x"]  # y is of this schema and current: reused


def test_failed_stage_leaves_no_directory(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(StageError):
        run_stage(SPECS["fail"], run, Config(), {}, SPECS)
    assert not run.exists()


def test_missing_upstream_is_a_clear_error(tmp_path):
    with pytest.raises(StageError, match="stage 'a' has not run"):
        run_stage(SPECS["b"], tmp_path, Config(), {}, SPECS)


def test_an_after_stage_is_optional_and_hashed_once_it_ran(tmp_path):
    CALLS.clear()
    cfg = Config()
    run_stage(SPECS["d"], tmp_path, cfg, {}, SPECS)  # "a" has not run: d runs anyway
    run_stage(SPECS["d"], tmp_path, cfg, {}, SPECS)  # unchanged: no-op
    assert CALLS.count("b") == 1
    run_stage(SPECS["a"], tmp_path, cfg, {}, SPECS)
    run_stage(SPECS["d"], tmp_path, cfg, {}, SPECS)  # a's output appeared: d re-runs
    assert CALLS.count("b") == 2


def test_atomic_dir_replaces_only_on_success(tmp_path):
    target = tmp_path / "d"
    with atomic_dir(target) as tmp:
        (tmp / "f").write_text("1")
    with pytest.raises(ValueError):
        with atomic_dir(target) as tmp:
            (tmp / "f").write_text("2")
            raise ValueError
    assert (target / "f").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


# ---------------------------------------------------------------- prepare


def _write_cfg(tmp_path, data) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_prepare_local_dir_then_noop_then_dtype_change(tmp_path, tiny_model_dir, capsys):
    run = tmp_path / "run"
    cfg = _write_cfg(tmp_path, {"prepare": {"dtype": "float32"}})
    argv = ["prepare", "--run", str(run), "--config", str(cfg), "--model", str(tiny_model_dir)]
    assert main(argv) == 0
    meta = json.loads((run / "model" / "meta.json").read_text())
    assert meta["source"]["kind"] == "local" and meta["dtype"] == "float32"
    assert meta["layers"] == 4 and meta["kv_heads"] == 2 and meta["parameters"] > 0
    assert len(next(iter(meta["weights_sha256"].values()))) == 64
    from pipeline.variants.schemes import load_variant

    model, tok = load_variant(run / "model", device="cpu")
    assert model.config.num_hidden_layers == 4 and len(tok) == model.config.vocab_size
    capsys.readouterr()
    assert main(argv) == 0
    assert "prepare: up to date" in capsys.readouterr().err
    cfg = _write_cfg(tmp_path, {"prepare": {"dtype": "bfloat16"}, "gate": {"margin": 0.2}})
    assert main(argv[:4] + [str(cfg)] + argv[5:]) == 0
    assert json.loads((run / "model" / "meta.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    "model, message",
    [
        ("./no/such/dir", "is not a known alias"),
        ("someorg/some-model", "hub is unreachable"),
        ("not a model!", "is not a known alias"),
    ],
)
def test_prepare_bad_model_one_line(tmp_path, capsys, model, message):
    run = tmp_path / "run"
    rc = main(["prepare", "--run", str(run), "--config", str(REPO / "configs/smoke.yaml"), "--model", model])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0] and model in err[0]
    assert not run.exists()


def test_prepare_dir_without_config_json(tmp_path, capsys):
    d = tmp_path / "notamodel"
    d.mkdir()
    run = tmp_path / "run"
    rc = main(["prepare", "--run", str(run), "--config", str(REPO / "configs/smoke.yaml"), "--model", str(d)])
    assert rc == 2 and "no config.json" in capsys.readouterr().err
    assert not run.exists()


def test_stage_registry_is_consistent():
    for spec in STAGES.values():
        for up in spec.upstream + spec.after:
            assert list(STAGES).index(up) < list(STAGES).index(spec.name)
        assert spec.sections, spec.name


def test_prepare_embedded_model(embedded_model_dir):
    meta = json.loads((embedded_model_dir / "meta.json").read_text())
    assert meta["source"]["kind"] == "gguf"
    assert (meta["layers"], meta["hidden_size"], meta["heads"], meta["kv_heads"], meta["vocab_size"]) == (
        30, 576, 9, 3, 49152)
    assert 130e6 < meta["parameters"] < 140e6
    assert meta["bytes"] < 300 * 2**20  # bf16, tied embeddings stored once


def test_stage_code_hash_follows_imports_not_the_whole_tree():
    from pipeline.core.stage import REPO as ROOT, import_closure

    def rel(mod):
        return {str(p.relative_to(ROOT)) for p in import_closure([mod])}

    acceptance, quality, gate = rel("pipeline.stages.acceptance"), rel("pipeline.stages.quality"), rel("pipeline.stages.gate")
    # Direct, indirect (the scheme registry through load_variant) and package imports are followed...
    assert {"pipeline/decode/engine.py", "pipeline/decode/sampling.py", "pipeline/decode/drafts.py",
            "pipeline/decode/__init__.py", "pipeline/variants/schemes.py", "draft_models/__init__.py",
            "draft_models/ngram.py", "pipeline/__init__.py"} <= acceptance
    assert {"pipeline/quality/distribution.py", "pipeline/stats/paired.py", "evals/generate.py"} <= quality
    # ...and a module a stage never imports does not re-run it.
    assert "pipeline/stages/gate.py" not in acceptance | quality and "pipeline/stages/quality.py" not in gate
    assert rel("numpy") == set() and rel("pipeline.nonexistent") == set()


def test_decode_package_imports_nothing_from_the_stages():
    """pipeline.decode is the core other code builds on: its modules import only each other (and
    the package __init__ files, which only document), never a stage, StageError or draft_models."""
    from pipeline.core.stage import REPO as ROOT, import_closure

    modules = [f"pipeline.decode.{p.stem}" for p in sorted((ROOT / "pipeline/decode").glob("*.py"))
               if p.stem != "__init__"]
    files = {str(p.relative_to(ROOT)) for p in import_closure(modules)}
    assert "pipeline/decode/engine.py" in files and "pipeline/decode/drafts.py" in files
    assert {f for f in files if not f.startswith("pipeline/decode/")} == {"pipeline/__init__.py"}, files


def test_editing_an_imported_module_changes_the_hash(tmp_path, monkeypatch):
    import pipeline.core.stage as stage

    pkg = tmp_path / "pipeline"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pipeline import b\n    return b.X\n")
    (pkg / "b.py").write_text("X = 1\n")
    (pkg / "c.py").write_text("Y = 1\n")
    monkeypatch.setattr(stage, "REPO", tmp_path)
    before = stage.code_hash(["import:pipeline.a"])
    (pkg / "c.py").write_text("Y = 2\n")
    assert stage.code_hash(["import:pipeline.a"]) == before
    (pkg / "b.py").write_text("X = 2\n")
    assert stage.code_hash(["import:pipeline.a"]) != before


def test_per_slice_settings_merge_over_the_defaults():
    """A config names only what it changes in quality.per_slice; the rest keeps its default."""
    from pipeline.core.quality_config import PER_SLICE_DEFAULTS, QualityConfig

    q = QualityConfig(items_per_slice=7, per_slice={"bfcl": {"items": "all"}, "mmlu": {"items": 50}})
    assert q.items_for("bfcl") is None and q.max_new_tokens_for("bfcl") == PER_SLICE_DEFAULTS["bfcl"]["max_new_tokens"]
    assert q.items_for("code") == PER_SLICE_DEFAULTS["code"]["items"] and q.items_for("mmlu") == 50
    assert q.items_for("reasoning") == 7 and q.max_new_tokens_for("reasoning") == q.max_new_tokens
    with pytest.raises(Exception, match="items"):
        QualityConfig(per_slice={"bfcl": {"items": "most"}})
