"""The `specq` command: the console script installs, every command has its own help and takes
only its own flags, and `python -m pipeline` is the same command line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.__main__ import _parser
from pipeline.stages.table import STAGES

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ["evaluate", *STAGES, "gate-check", "summary", "config"]


def _choices() -> dict:
    sub = next(a for a in _parser()._actions if a.dest == "command")
    return sub.choices


def test_every_command_has_its_own_help_and_flags():
    choices = _choices()
    assert sorted(choices) == sorted(set(COMMANDS))
    for name, sp in choices.items():
        flags = {o for a in sp._actions for o in a.option_strings}
        assert sp.format_help().startswith(f"usage: specq {name}"), name
        assert all(a.help for a in sp._actions if a.option_strings), name  # every flag says what it does
        # gate's own flags are gate's; no stage takes them.
        assert ("--variant" in flags) == (name == "gate"), name
        assert ("--no-exit-code" in flags) == (name in ("gate", "gate-check")), name
        assert ("--force" in flags) == (name in ("evaluate", *STAGES)), name


@pytest.mark.parametrize("argv", [["quantize", "--no-exit-code"], ["summary", "--force"], ["config", "--run", "x"],
                                  ["gate-check", "--variant", "a"], ["nope"]])
def test_a_flag_a_command_does_not_take_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_the_console_script_and_python_m_pipeline():
    script = Path(sys.executable).parent / "specq"
    assert script.is_file(), "the specq console script is missing: pip install -e . (make install) writes it"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: specq ") and "gate" in out.stdout
    out = subprocess.run([str(script), "gate", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--variant" in out.stdout and "3 inconclusive" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m pipeline ")
