"""Prompt datasets and templates."""

from megamu.data.arithmetic import DEMO_FEW_SHOT, DEMO_INSTRUCTION, addition_problems
from megamu.data.prompts import DEFAULT_INSTRUCTION, PromptDataError, PromptRecord, load_prompts, render_prompt

__all__ = [
    "DEFAULT_INSTRUCTION",
    "DEMO_FEW_SHOT",
    "DEMO_INSTRUCTION",
    "PromptDataError",
    "PromptRecord",
    "addition_problems",
    "load_prompts",
    "render_prompt",
]
