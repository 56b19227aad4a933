"""Process-wide settings an entry point makes once, before any library is imported or used.

    from pipeline.core.process import set_up_process
    set_up_process()        # python -m pipeline, python -m pipeline.tools.bench, tests/conftest.py

Nothing here runs on import: a library module of specq never changes process state as a side
effect of being imported.
"""
from __future__ import annotations

import logging
import os


def set_up_process() -> None:
    # torchao registers Enum pytree constants on import, which torch 2.14 logs as a deprecation
    # warning on every process start; it says nothing about specq's run.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # The tokenizers library warns (and may deadlock) when a process forks after it used threads;
    # the sandbox and the data loaders fork.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
