"""Workloads (pipeline/speculation/workload.py): ShareGPT's truncated file read to its last complete
record, vLLM's prompt / output convention, the user's file in its three shapes and its bad lines
(exit 2 with the line number), the seeded stratified draw, too-long prompts skipped and counted,
and the built-in default equal to the prompts the stages always measured."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.config import Config
from pipeline.core.stage import StageError
from pipeline.speculation.prompts import KINDS, PROMPTS, prompt_ids
from pipeline.speculation.workload import (
    draw_order, interleave, load_pool, load_workload, precheck, read_json_array, read_sharegpt, sharegpt_path, workload_prompts,
    workload_summary,
)

ROOT = Path(__file__).resolve().parent.parent


def _cfg(**acceptance) -> Config:
    return Config.model_validate({"acceptance": acceptance})


def _conv(*turns) -> dict:
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_file_keeps_every_complete_conversation():
    """The shipped file is cut mid-record: the reader keeps the 17,671 complete conversations."""
    complete, entries = read_sharegpt(sharegpt_path())
    assert complete == 17671
    # A human turn followed by a reply: the 271 with fewer than 2 turns are among those dropped.
    assert 17000 < len(entries) <= 17671 - 271
    assert all(e.text.strip() and e.reply.strip() for e in entries[:500])


def test_sharegpt_convention_on_a_synthetic_truncated_file(tmp_path, tiny_tokenizer):
    """First human turn = prompt, the reply after it = output length; leading assistant turns are
    passed over; < 2 turns, no human turn, and a prompt or reply under 4 tokens are dropped; the cut
    tail record is not read."""
    recs = [
        _conv(("human", "Tell me a story about the lighthouse keeper and his logbooks."),
              ("gpt", "Once upon a time there was a keeper who wrote in three logbooks every day.")),
        _conv(("gpt", "Hello! How can I help?"), ("human", "Explain what a warehouse does for orders."),
              ("gpt", "A warehouse stores goods and ships the orders that customers place.")),
        _conv(("human", "only one turn here")),
        _conv(("gpt", "no human at all"), ("gpt", "still none")),
        _conv(("human", "Say hi"), ("gpt", "hi")),  # a 1-2 token reply: vLLM's filter drops it
    ]
    text = json.dumps(recs, indent=2)
    cut = text[:-1].rstrip().rstrip("]").rstrip() + ",\n" + json.dumps(recs[0], indent=2)[:70]
    path = tmp_path / "cut.json"
    path.write_text(cut)
    complete, entries = read_sharegpt(path)
    assert complete == 5
    assert [e.text for e in entries] == ["Tell me a story about the lighthouse keeper and his logbooks.",
                                         "Explain what a warehouse does for orders.", "Say hi"]
    assert entries[1].reply.startswith("A warehouse stores")
    # Without allow_cut, the same text is an error naming the cut line.
    with pytest.raises(ValueError, match=r"^line \d+: not JSON"):
        list(read_json_array(cut, allow_cut=False))

    # The draw applies vLLM's too-short filter and measures the reply in tokens.
    from pipeline.speculation import workload as wl_mod

    pool = wl_mod.Pool("sharegpt", "test", ["sharegpt"], {"sharegpt": entries}, min_tokens=wl_mod.MIN_TOKENS)
    wl_mod._pool.cache_clear()
    orig = wl_mod.load_pool
    wl_mod.load_pool = lambda name: pool
    try:
        wl = load_workload(_cfg(workload="sharegpt", workload_prompts=3).acceptance, 0, tokenizer=tiny_tokenizer,
                           max_prompt_tokens=1024)
    finally:
        wl_mod.load_pool = orig
    assert wl.skipped_too_short == 1 and len(wl.prompts) == 2 and wl.short == {"sharegpt": (3, 2)}
    for p in wl.prompts:
        entry = entries[int(p.id.split("-")[1])]
        assert p.output_tokens == len(tiny_tokenizer.encode(entry.reply, add_special_tokens=False)) >= 4


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_user_file_in_each_shape(tmp_path, tiny_tokenizer):
    plain = _write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "Summarize: the cat sat on the mat.", "category": "summarize", "output_tokens": 12},
        {"prompt": "Hello there, how are you?"},
        {"prompt": "Summarize: dogs bark at night.", "category": "summarize"},
    ])
    wl = load_workload(_cfg(workload=str(plain), prompts_per_kind=5).acceptance, 0)
    assert wl.name == str(plain) and wl.categories == ["summarize", "user"]
    assert {p.id: p.output_tokens for p in wl.prompts} == {"summarize-0": 12, "summarize-1": None, "user-0": None}

    msgs = _write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                      {"role": "assistant", "content": "Four, which is the sum of two and two."}]},
        {"messages": [{"role": "user", "content": "Name a colour."}]},
    ])
    wl = load_workload(_cfg(workload=str(msgs), prompts_per_kind=5).acceptance, 0, tokenizer=tiny_tokenizer)
    by_id = {p.id: p for p in wl.prompts}
    assert by_id["user-0"].text == "What is 2+2?" and by_id["user-1"].output_tokens is None
    assert by_id["user-0"].output_tokens == len(tiny_tokenizer.encode("Four, which is the sum of two and two.",
                                                                      add_special_tokens=False))

    conv = _write_jsonl(tmp_path / "c.jsonl", [_conv(("human", "Why is the sky blue?"), ("gpt", "Scattering."))])
    listed = tmp_path / "c.json"
    listed.write_text(json.dumps([_conv(("human", "Why is the sky blue?"), ("gpt", "Scattering."))], indent=1))
    for path in (conv, listed):
        wl = load_workload(_cfg(workload=str(path)).acceptance, 0)
        assert [(p.id, p.text) for p in wl.prompts] == [("user-0", "Why is the sky blue?")]


BAD = [
    ('{"prompt": "ok"}\nnot json at all\n', 2, "not JSON"),
    ('{"prompt": "ok"}\n\n{"prompt": "   "}\n', 3, "empty prompt"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}\n', 1, "no human/user turn"),
    ('{"conversations": [{"from": "gpt", "value": "hi"}]}\n', 1, "no human/user turn"),
]


@pytest.mark.parametrize("text,line,why", BAD)
def test_bad_line_is_refused_with_its_number(tmp_path, text, line, why):
    path = tmp_path / "w.jsonl"
    path.write_text(text)
    with pytest.raises(StageError, match=rf"line {line}: {why}"):
        precheck(_cfg(workload=str(path)), {})


def test_bad_line_exits_2_with_one_line_before_any_work(tmp_path):
    """The command line refuses the file before prepare does anything: exit 2, one line on stderr."""
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "fine too"}\n{"prompt": ""}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"acceptance:\n  workload: {path}\nquality:\n  slices: [reasoning]\n")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "prepare", "--run", str(run), "--config", str(cfg)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "line 3: empty prompt" in lines[0] and str(path) in lines[0]
    assert not run.exists()


def test_unknown_category_and_missing_file_are_refused(tmp_path):
    with pytest.raises(StageError, match="'nope' is not a category of workload builtin"):
        precheck(_cfg(categories=["chat", "nope"]), {})
    with pytest.raises(StageError, match="is not builtin, sharegpt or a file"):
        precheck(_cfg(workload=str(tmp_path / "missing.jsonl")), {})


def _pool_file(tmp_path: Path, sizes: dict[str, int]) -> Path:
    rows = [{"prompt": f"{cat} prompt number {i} " + "word " * (i % 7), "category": cat}
            for cat, n in sizes.items() for i in range(n)]
    return _write_jsonl(tmp_path / "pool.jsonl", rows)


def test_seeded_draw_is_stratified_deterministic_and_nested(tmp_path):
    path = _pool_file(tmp_path, {"a": 50, "b": 50, "c": 3})
    acc = _cfg(workload=str(path), workload_prompts=10).acceptance
    one, again, other = (load_workload(acc, s) for s in (0, 0, 1))
    ids = [p.id for p in one.prompts]
    assert ids == [p.id for p in again.prompts] and ids != [p.id for p in other.prompts]
    count = {c: sum(p.category == c for p in one.prompts) for c in "abc"}
    assert count == {"a": 4, "b": 3, "c": 3} and one.short == {}  # 10 over 3: the first takes one more
    assert sorted(p.id for p in one.prompts if p.category == "c") == ["c-0", "c-1", "c-2"]
    # Not the file's order: a seeded permutation of each category.
    assert [p.id for p in one.prompts if p.category == "a"] != ["a-0", "a-1", "a-2", "a-3"]
    # A smaller draw is the start of a larger one (latency's prompts are among acceptance's).
    small = load_workload(acc, 0, per_category=2)
    for c in "ab":
        assert [p.id for p in small.prompts if p.category == c] == [p.id for p in one.prompts if p.category == c][:2]
    # A category with fewer than its share gives all it has, and says so.
    short = load_workload(_cfg(workload=str(path), workload_prompts=30).acceptance, 0)
    assert short.short == {"c": (10, 3)}
    assert {c: sum(p.category == c for p in short.prompts) for c in "abc"} == {"a": 10, "b": 10, "c": 3}
    # Over many seeds every prompt of a category is drawn about equally often (uniform draw).
    hits = {}
    for s in range(400):
        for p in load_workload(acc, s).prompts:
            hits[p.id] = hits.get(p.id, 0) + 1
    a_hits = [hits.get(f"a-{i}", 0) for i in range(50)]
    # 400 draws x 4 of 50: 32 expected per prompt, sd ~5.4; all within 5 sd.
    assert min(a_hits) > 32 - 27 and max(a_hits) < 32 + 27


def test_too_long_prompts_are_skipped_counted_and_replaced(tmp_path, tiny_tokenizer, capsys):
    rows = [{"prompt": "short question " + str(i)} for i in range(6)]
    rows[0]["prompt"] = rows[2]["prompt"] = "a very long prompt " * 200
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    cfg = Config.model_validate({"acceptance": {"workload": str(path), "prompts_per_kind": 3,
                                                "max_prompt_tokens": 64}})
    prompts = workload_prompts(cfg, tiny_tokenizer, "test")
    # The seeded order, the long ones (0 and 2) passed over until 3 short ones are in.
    order = [int(j) for j in draw_order(load_pool(str(path)), "user", 0)]
    expected, skipped = [], 0
    for j in order:
        if len(expected) == 3:
            break
        if j in (0, 2):
            skipped += 1
        else:
            expected.append(f"user-{j}")
    assert [pid for pid, _ in prompts["user"]] == expected and skipped >= 1
    assert all(len(ids) <= 64 for _, ids in prompts["user"])
    summary = workload_summary(prompts)
    assert summary["skipped_too_long"] == skipped and summary["cut"] == 0 and summary["n_prompts"] == 3
    assert f"skipped {skipped} prompts longer than 64 tokens" in capsys.readouterr().err
    # The model's context caps the limit: context - the most new tokens - (k_max + 1).
    tight = workload_prompts(cfg.model_copy(update={"acceptance": cfg.acceptance.model_copy(
        update={"max_prompt_tokens": 4096})}), tiny_tokenizer, "test", context=64 + 48 + 7)
    assert summary["prompts"] and workload_summary(tight)["max_prompt_tokens"] == 64
    assert [pid for pid, _ in tight["user"]] == expected


def test_builtin_default_is_the_prompts_the_stages_always_measured(tiny_tokenizer):
    """acceptance.workload: builtin with default settings gives the first prompts_per_kind of every
    kind, in KINDS order, with their old ids and token ids; the batched rows are every prompt,
    kinds in turn (what batch_prompts always took)."""
    cfg = Config()
    prompts = workload_prompts(cfg, tiny_tokenizer, "test")
    n = cfg.acceptance.prompts_per_kind
    assert list(prompts) == list(KINDS)
    for kind in KINDS:
        assert prompts[kind] == [(f"{kind}-{i}", prompt_ids(tiny_tokenizer, t)) for i, t in
                                 enumerate(PROMPTS[kind][:n])]
    summary = workload_summary(prompts)
    assert summary["name"] == "builtin" and summary["categories"] == list(KINDS)
    assert summary["n_prompts"] == n * len(KINDS) and all(p["output_tokens"] is None for p in summary["prompts"])
    # (The tiny test tokenizer makes some long prompts over 1024 tokens; SmolLM2's longest is 359.)
    roomy = Config.model_validate({"acceptance": {"max_prompt_tokens": 100_000}})
    rows = interleave(workload_prompts(roomy, tiny_tokenizer, "test", 100, quiet=True))
    texts = [t for i in range(max(map(len, PROMPTS.values()))) for kind in KINDS for t in PROMPTS[kind][i:i + 1]]
    assert [ids for _, ids in rows] == [prompt_ids(tiny_tokenizer, t) for t in texts]


def test_user_file_digest_enters_the_config_section(tmp_path):
    """Editing the user's file changes the acceptance section the stages hash, so they re-run."""
    path = _write_jsonl(tmp_path / "w.jsonl", [{"prompt": "one"}])
    before = _cfg(workload=str(path)).section("acceptance")
    _write_jsonl(path, [{"prompt": "two"}])
    after = _cfg(workload=str(path)).section("acceptance")
    assert before["workload_sha256"] != after["workload_sha256"] and _cfg().section("acceptance")[
        "workload_sha256"] is None
    # The printed resolved config loads again.
    assert Config.model_validate({"acceptance": after}).acceptance.workload == str(path)


def _acceptance_inputs(cfg: Config, tmp_path) -> dict:
    """The acceptance stage's input dict for its one pair, caught at ctx.item before any work."""
    from types import SimpleNamespace

    from draft_models.registry import draft_slug
    from pipeline.stages import acceptance

    for d in ("variants/bf16", f"drafts/{draft_slug('ngram')}"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / d / "meta.json").write_text('{"input_hash": "h"}')
    seen = []

    def item(name, inputs, is_dir=True):
        seen.append(inputs)
        raise KeyboardInterrupt  # stop here: nothing is loaded

    ctx = SimpleNamespace(config=cfg, run_dir=tmp_path, item=item)
    with pytest.raises(KeyboardInterrupt):
        acceptance.run(ctx)
    return seen[0]


def test_prompt_limit_terms_hashed_alike_by_acceptance_and_latency(tmp_path):
    """Review 2: the prompt-length limit reads latency.new_tokens and k_max as
    well as acceptance's keys; both stages hash the same prompt_limit_inputs, so a change that can
    move the limit (and so the prompts drawn on a short-context model) re-runs both, and one that
    cannot re-runs neither for this reason."""
    from pipeline.speculation.workload import prompt_limit, prompt_limit_inputs
    from pipeline.stages.latency import workload_inputs

    def both(**latency):
        cfg = Config.model_validate({"drafts": ["ngram"], "quantize": {"reference": "bf16"},
                                     "acceptance": {"targets": ["bf16"], "max_new_tokens": 32, "k_max": 4},
                                     "latency": {"new_tokens": 16, **latency}})
        return cfg, _acceptance_inputs(cfg, tmp_path)["prompt_limit"], workload_inputs(cfg)["prompt_limit"]

    cfg, acc0, lat0 = both(new_tokens=40)
    assert acc0 == lat0 == prompt_limit_inputs(cfg)
    assert prompt_limit(cfg, 100) == 100 - 40 - 5  # the limit is these terms and the context alone
    _, acc1, lat1 = both(new_tokens=64)
    assert acc1 == lat1 != acc0 and acc1["generated"] == 64
    _, acc2, lat2 = both(new_tokens=20)  # below acceptance.max_new_tokens: the limit cannot move
    assert acc2 == lat2 and acc2["generated"] == 32
    _, acc3, lat3 = both(new_tokens=40, k_max=7)
    assert acc3 == lat3 and acc3["verify_width"] == 8


def test_fewer_workload_prompts_than_categories_is_refused(tmp_path):
    """Review 3: 5 prompts over the 8 built-in categories would leave 3 with none (and the stage
    would drop them and exit 0): refused before any work, one line, exit 2."""
    n_cats = len(KINDS)
    with pytest.raises(StageError, match=rf"acceptance.workload_prompts = 5 is fewer than the {n_cats} categories"
                                         r".*raise it or set acceptance.categories"):
        precheck(_cfg(workload_prompts=5), {})
    precheck(_cfg(workload_prompts=n_cats), {})  # one each is enough
    precheck(_cfg(workload_prompts=2, categories=["chat", "code"]), {})
    cfg = tmp_path / "c.yaml"
    cfg.write_text("acceptance:\n  workload_prompts: 3\nquality:\n  slices: [reasoning]\n")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "prepare", "--run", str(run), "--config", str(cfg)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "workload_prompts = 3 is fewer than" in proc.stderr and not run.exists()


def test_user_file_bom_suffix_case_and_text_after_the_array(tmp_path):
    """Review 7: a byte-order mark (as Windows editors write) is not 'line 1: not JSON'; '.JSON' is a
    JSON list like '.json'; text after a .json file's closing ']' is refused with its line."""
    rec = _conv(("human", "Why is the sky blue?"), ("gpt", "Scattering."))
    bom_jsonl = tmp_path / "bom.jsonl"
    bom_jsonl.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "Hello there"}).encode() + b"\n")
    upper = tmp_path / "list.JSON"
    upper.write_bytes(b"\xef\xbb\xbf" + json.dumps([rec], indent=1).encode())
    for path, text in ((bom_jsonl, "Hello there"), (upper, "Why is the sky blue?")):
        precheck(_cfg(workload=str(path)), {})
        assert [p.text for p in load_workload(_cfg(workload=str(path)).acceptance, 0).prompts] == [text]
    trailing = tmp_path / "t.json"
    trailing.write_text(json.dumps([rec], indent=1) + "\n\n" + json.dumps([rec]) + "\n")
    n = json.dumps([rec], indent=1).count("\n") + 3
    with pytest.raises(StageError, match=rf"line {n}: text after the array's closing '\]'"):
        precheck(_cfg(workload=str(trailing)), {})
    empty_then = tmp_path / "e.json"
    empty_then.write_text("[]\nx\n")
    with pytest.raises(StageError, match=r"line 2: text after"):
        precheck(_cfg(workload=str(empty_then)), {})
    assert list(read_json_array("[1, 2]  \n", allow_cut=False)) == [(1, 1), (2, 1)]
