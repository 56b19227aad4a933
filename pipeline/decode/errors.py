"""The decode package's own error: a model, draft or argument the engine cannot run.

It imports nothing from the stages; a stage that calls the engine lets EngineError through to
the command line, which prints its one-line message and exits 2 (pipeline/__main__.py).
"""


class EngineError(Exception):
    """A model or draft the engine cannot run; one line for the user."""
