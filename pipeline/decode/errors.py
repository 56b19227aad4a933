"""The decode package's own error, in a module that imports nothing: the command line catches it
(one line, exit 2) without importing torch before its process settings are made.
"""


class EngineError(Exception):
    """A model or draft the engine cannot run; one line for the user."""
