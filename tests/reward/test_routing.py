"""Issue #45, item 2: a row's data_source routes to megamu's own scorer, as verl's default_compute_score routes
(verl/utils/reward_score/__init__.py), so verl's preprocessed rows train without a user function. Expected scores
are by hand from each data set's answer format."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megamu.data import load_prompts
from megamu.reward import RewardConfig, make_scorer, math_score
from megamu.reward.math import gsm8k_answer, gsm8k_score
from megamu.reward.routing import dapo_score, data_source_score, scorer_for
from megamu.reward.signatures import RowMeta
from tests.data.test_user_rows import VERL_ROW
from tests.tiny import build_char_tokenizer


@pytest.mark.parametrize("text, answer", [
    ("so she sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("#### 1,234.", "1234"),  # commas go (verl); a sentence's period too (megamu)
    ("#### -5 then #### 7", "-5"),  # the first answer line, as verl's re.search
    ("#### $8", None),  # verl's pattern wants a digit right after '#### '
    ("the answer is 72", None),
])
def test_gsm8k_answer_line(text, answer):
    assert gsm8k_answer(text) == answer


def test_gsm8k_scores_by_the_answer_line_where_the_math_reward_scores_zero():
    reply = "Natalia sold 48/2 = 24 clips in May, 48 + 24 = 72 in all.\n#### 72"
    assert gsm8k_score(reply, "72") == 1.0 and gsm8k_score(reply, "71") == 0.0
    assert gsm8k_score(reply, "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == 1.0  # GSM8K's raw answer field
    assert math_score(reply, "72") == 0.0  # what `--reward math` gave verl's GSM8K rows before


@pytest.mark.parametrize("source, scorer", [
    ("openai/gsm8k", gsm8k_score), ("lighteval/MATH", math_score), ("DigitalLearningGmbH/MATH-lighteval", math_score),
    ("HuggingFaceH4/MATH-500", math_score), ("numina_olympiads", math_score), ("math_dapo", dapo_score),
    ("aime_2024", dapo_score), ("", math_score), ("my_own_set", math_score),
])
def test_routing_table(source, scorer):
    assert scorer_for(source) is scorer


def test_dapo_answer_line_and_boxed_scored_plus_or_minus_one_as_verls_math_dapo():
    """verl/utils/reward_score/math_dapo.py:265 (b178a3c), compute_score: ``reward = 1.0 if correct else -1.0``."""
    assert dapo_score("work...\nAnswer: \\frac{3}{4}", "\\frac{3}{4}") == 1.0
    assert dapo_score("Answer: 5\nno wait\nAnswer: 6.", "6") == 1.0  # the last answer line
    assert dapo_score("so \\boxed{6}", "6") == 1.0 and dapo_score("Answer: 7", "6") == -1.0
    assert dapo_score("no answer at all", "6") == -1.0


def test_a_verl_gsm8k_row_is_scored_without_a_user_function(tmp_path):
    """verl's gsm8k parquet row read by megamu's loader, its replies scored by the default reward (no --reward-fn)."""
    pq.write_table(pa.Table.from_pylist([VERL_ROW]), tmp_path / "train.parquet")
    rec, = load_prompts([str(tmp_path / "train.parquet")], build_char_tokenizer(), prompt_key="prompt")
    replies = ["48 / 2 = 24, 48 + 24 = 72\n#### 72", "#### 70", "\\boxed{72}"]
    with make_scorer(RewardConfig()) as scorer:  # the default: math, routed by data_source
        assert scorer.score(replies, [rec.answer] * 3, [rec.meta] * 3) == [1.0, 0.0, 0.0]
        # megamu's own rows (no data_source) keep the math reward
        assert scorer.score(replies, ["72"] * 3, [RowMeta()] * 3) == [0.0, 0.0, 1.0]
    assert data_source_score("openai/gsm8k", replies[0], "72") == 1.0
