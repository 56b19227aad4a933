"""Process-wide settings an entry point makes once (set_up_process), before any library is imported
or used. Nothing here runs on import: no specq module changes process state by being imported.
"""
from __future__ import annotations

import importlib.util
import logging
import os


# Loggers that fill a run's log between specq's own lines, and the level they keep (GPTQModel's
# tokenizer fixer, accelerate's tie-weights notice, torch's "no CUDA runtime", bitsandbytes' notices).
CHATTY_LOGGERS = {"tokenicer": logging.WARNING, "accelerate": logging.ERROR, "torch.utils.cpp_extension": logging.ERROR,
                  "bitsandbytes.backends.cpu.ops": logging.ERROR, "bitsandbytes.autograd._functions": logging.ERROR}

# Third-party progress bars and notices, off in `python -m pipeline` unless the user set the variable.
QUIET_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def bars_off() -> bool:
    """Whether tqdm's bars are off (TQDM_DISABLE), for a bar created with an explicit `disable=`."""
    return os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes")


def _quiet_logbar() -> None:
    """GPTQModel's LogBar (which python's logging levels do not reach) down to warnings, where it exists."""
    if importlib.util.find_spec("logbar") is None:
        return
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its import writes a blank line to stdout
            from logbar import LogBar

            LogBar.shared().setLevel("WARN")
    except (ImportError, AttributeError, TypeError, ValueError):
        pass


def set_up_process(quiet: bool = False) -> None:
    """quiet: third-party progress bars and INFO logs off (QUIET_ENV, CHATTY_LOGGERS), unless
    SPECQ_VERBOSE is set and not 0. Call before the libraries are imported (tqdm reads TQDM_ then)."""
    if quiet and os.environ.get("SPECQ_VERBOSE", "0") in ("", "0"):
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
        for name, level in CHATTY_LOGGERS.items():
            logging.getLogger(name).setLevel(level)
        _quiet_logbar()
    # torchao's Enum pytree constants make torch log a deprecation warning on every process start.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # The tokenizers library warns (and may deadlock) when a process forks after it used threads;
    # the sandbox and the data loaders fork.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # GPTQModel sizes its CPU pools from this, and with its default of one worker refuses to load.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
