"""The base of every config section (pipeline/core/config.py, pipeline/core/quality_config.py):
unknown keys are errors."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
