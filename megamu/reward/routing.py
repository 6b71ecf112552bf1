"""megamu's default reward: a row's ``data_source`` picks the scorer, as verl's ``default_compute_score``
(verl/utils/reward_score/__init__.py) does, with megamu's own scorers, so the parquet files of verl's data
preprocessing (examples/data_preprocess/gsm8k.py, math_dataset.py ...) train without a user function.

  openai/gsm8k                                          -> gsm8k_score: the reply's ``#### N`` answer line
  lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,
  HuggingFaceH4/MATH-500, numina_* , hiyouga/geometry3k -> math_score: the last \\boxed{} (math-verify)
  math_dapo, aime*                                      -> dapo_score: DAPO's ``Answer: X`` line, or the last \\boxed{}
  anything else, or no data_source (megamu's own rows)  -> math_score

dapo_score gives verl's math_dapo values, 1 right / -1 wrong (verl/utils/reward_score/math_dapo.py compute_score):
the group advantages are the same as with 1 / 0, but DAPO's overlong penalty (down to -1) weighs against a gap of 2,
as in verl's recipe. megamu's other scorers give 1 / 0, as verl's gsm8k and math do. Choices, where verl differs: an
unknown data_source is scored as math (verl raises NotImplementedError); the code sources (codecontests, apps, ...)
need --reward code, whose rows carry tests in megamu's format.
"""

from __future__ import annotations

import re

from megamu.reward.math import gsm8k_score, math_score

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
                "hiyouga/geometry3k")
# DAPO's answer line (verl/utils/reward_score/math_dapo.py ``is_correct_minerva``'s pattern)
ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def dapo_score(response: str, ground_truth: str) -> float:
    """DAPO-Math-17k's format: the last ``Answer: X`` line, checked as a \\boxed{X} answer; else the last \\boxed{}.
    1.0 right, -1.0 wrong (verl's math_dapo score)."""
    lines = ANSWER_LINE.findall(response)
    text = "\\boxed{" + lines[-1].strip().rstrip(".").strip("$") + "}" if lines else response
    return 1.0 if math_score(text, ground_truth) == 1.0 else -1.0


def scorer_for(data_source: str):
    """The scorer of ``data_source`` (see the module docstring)."""
    if data_source == "openai/gsm8k":
        return gsm8k_score
    if data_source == "math_dapo" or data_source.startswith("aime"):
        return dapo_score
    if data_source in MATH_SOURCES or data_source.startswith("numina_"):
        return math_score
    return math_score  # megamu's own rows and unknown sources


def data_source_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """verl's signature (the pool passes each row's data_source): the score of the scorer its source routes to."""
    return scorer_for(data_source or "")(solution_str, ground_truth)
