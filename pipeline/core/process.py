"""Process-wide settings an entry point makes once, before any library is imported or used.

    from pipeline.core.process import set_up_process
    set_up_process()        # python -m pipeline, python -m pipeline.tools.bench, tests/conftest.py

Nothing here runs on import: a library module of specq never changes process state as a side
effect of being imported.
"""
from __future__ import annotations

import importlib.util
import logging
import os


# Loggers whose lines fill a run's log between specq's own stage lines, and the level they keep:
# GPTQModel's tokenizer fixer, accelerate's tie-weights notice on every quantized load, torch's
# "no CUDA runtime" notice on a CPU box, bitsandbytes' CPU kernel fallback and int8 input-cast notices.
CHATTY_LOGGERS = {"tokenicer": logging.WARNING, "accelerate": logging.ERROR, "torch.utils.cpp_extension": logging.ERROR,
                  "bitsandbytes.backends.cpu.ops": logging.ERROR, "bitsandbytes.autograd._functions": logging.ERROR}

# Progress bars and notices of third-party libraries, off by default in `python -m pipeline`: each
# stage prints its own progress with the time left. A variable the user set is left alone.
QUIET_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def bars_off() -> bool:
    """Whether tqdm's bars are off (TQDM_DISABLE), for a bar created with an explicit `disable=`."""
    return os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes")


def _quiet_logbar() -> None:
    """GPTQModel's LogBar (about 40 INFO lines per quantized load), which python's logging levels
    do not reach, down to warnings; nothing when it is not installed or its API moved."""
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
    SPECQ_VERBOSE is set to something other than 0 (make evaluate VERBOSE=1). Before the libraries
    are imported: tqdm reads its TQDM_ variables when it is imported."""
    if quiet and os.environ.get("SPECQ_VERBOSE", "0") in ("", "0"):
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
        for name, level in CHATTY_LOGGERS.items():
            logging.getLogger(name).setLevel(level)
        _quiet_logbar()
    # torchao registers Enum pytree constants on import, which torch 2.14 logs as a deprecation
    # warning on every process start; it says nothing about specq's run.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # The tokenizers library warns (and may deadlock) when a process forks after it used threads;
    # the sandbox and the data loaders fork.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # GPTQModel sizes its CPU pools from this, and with its default of one worker refuses to load
    # (a loader pool asks for two); make sets it too.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
