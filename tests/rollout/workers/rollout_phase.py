"""Run one rollout phase of a tiny model on arithmetic prompts (a subprocess of the resume test)."""

import sys

from megamu.data import DEMO_FEW_SHOT, DEMO_INSTRUCTION
from megamu.engines.local import LocalEngine
from megamu.reward import RewardScorer
from megamu.rollout.phase import run_rollout_phase
from tests.rollout.test_phase import SAMPLING, make_prompts
from tests.tiny import build_char_tokenizer


def main(hf_dir: str, out_dir: str) -> None:
    import torch

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    prompts = make_prompts(tok, DEMO_INSTRUCTION, DEMO_FEW_SHOT)
    with RewardScorer("tests.rollout.rewards:parity", num_workers=1) as scorer:
        run_rollout_phase(LocalEngine(hf_dir, max_batch_size=16), prompts, out_dir, sampling=SAMPLING, n_samples=4,
                          scorer=scorer, tokenizer=tok, stage=2, policy_version=7, groups_per_shard=2,
                          model_path=hf_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
