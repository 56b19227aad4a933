"""The config reference (docs/config.md, `specq config --explain`) is the schema's: every key has
a meaning, and the page is what the generator writes today."""
from __future__ import annotations

import re
from pathlib import Path

from pipeline.core.config import Config
from pipeline.core.config_doc import keys, render

REPO = Path(__file__).resolve().parent.parent


def test_every_key_has_a_type_a_default_and_a_meaning():
    found = keys()
    paths = [k.path for k in found]
    assert len(paths) == len(set(paths))
    # Every field of every section is listed (a dict of sections by its entries' fields).
    assert {p.split(".")[0] for p in paths} == set(Config.model_fields)
    for want in ("seed", "quantize.variants.<name>.scheme", "quality.vllm.batch_size", "vllm.open_loop.loads",
                 "budget.minutes", "speculation_engine"):
        assert want in paths, want
    missing = [k.path for k in found if not k.meaning.strip()]
    assert not missing, f"keys without a description in the schema: {missing}"
    assert all(k.type for k in found)
    assert next(k for k in found if k.path == "budget.minutes").default == "40.0"
    # No issue numbers: the page is for users.
    assert not [k.path for k in found if re.search(r"\bissue \d+|#\d{2}\b", k.meaning)]


def test_the_page_is_the_generators_output():
    page = (REPO / "docs" / "config.md").read_text()
    assert page == render(), "docs/config.md is stale: .venv/bin/specq config --explain > docs/config.md"
