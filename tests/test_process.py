"""Process set-up of the command line (pipeline/core/process.py): third-party progress bars and INFO
logs off by default, a user's own setting left alone, all of it back with SPECQ_VERBOSE=1."""
from __future__ import annotations

import logging

import pytest

from pipeline.core.process import CHATTY_LOGGERS, QUIET_ENV, set_up_process


@pytest.fixture
def clean(monkeypatch):
    for key in [*QUIET_ENV, "SPECQ_VERBOSE"]:
        monkeypatch.delenv(key, raising=False)
    levels = {name: logging.getLogger(name).level for name in CHATTY_LOGGERS}
    from logbar import LogBar

    bar = LogBar.shared().level
    yield monkeypatch
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    LogBar.shared().setLevel(bar)


def test_quiet_sets_the_defaults_and_keeps_what_the_user_set(clean):
    import os

    from logbar import LogBar

    clean.setenv("TQDM_DISABLE", "0")  # the user wants tqdm's bars
    set_up_process(quiet=True)
    assert os.environ["TQDM_DISABLE"] == "0"
    assert all(os.environ[k] == v for k, v in QUIET_ENV.items() if k != "TQDM_DISABLE")
    assert all(logging.getLogger(n).level == lv for n, lv in CHATTY_LOGGERS.items())
    assert LogBar.shared().level == logging.WARNING  # GPTQModel's INFO lines go, its warnings stay


def test_verbose_and_the_library_default_leave_everything_on(clean):
    import os

    from logbar import LogBar

    LogBar.shared().setLevel("INFO")
    clean.setenv("SPECQ_VERBOSE", "1")
    set_up_process(quiet=True)
    set_up_process()  # what the tests and the benches call: never quiet
    assert not any(k in os.environ for k in QUIET_ENV)
    assert LogBar.shared().level == logging.INFO


def test_bars_off_follows_tqdm_disable_for_bars_made_with_an_explicit_disable(clean):
    """The quality evaluator's own bars pass disable= explicitly, which overrides tqdm's reading of
    TQDM_DISABLE: they ask bars_off, so quiet reaches them and VERBOSE=1 brings them back."""
    from pipeline.core.process import bars_off

    assert not bars_off()
    set_up_process(quiet=True)
    assert bars_off()
    clean.setenv("TQDM_DISABLE", "0")
    assert not bars_off()


def test_the_command_line_imports_no_third_party_library_before_its_settings():
    """`python -m pipeline` makes its process settings (TQDM_DISABLE, ...) before torch or tqdm is
    imported: tqdm reads its variables on import, so an earlier import brings the bars back."""
    import subprocess
    import sys

    code = "import sys, pipeline.__main__; print(sorted({'torch', 'tqdm', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
