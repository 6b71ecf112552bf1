"""Print the summary of a stage dataset and a few decoded samples.

    python tools/inspect_rollouts.py rollouts/stage_0 [--tokenizer HF_DIR] [--num-samples 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamu.rollout.dataset import StageDataset  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage_dir")
    ap.add_argument("--tokenizer", default=None, help="HF folder with the tokenizer (default: the manifest's model)")
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="which samples to show")
    ap.add_argument("--max-chars", type=int, default=600)
    args = ap.parse_args(argv)

    ds = StageDataset(args.stage_dir)
    m = ds.manifest
    print(f"stage {m.stage} (policy version {m.policy_version}) in {args.stage_dir}")
    print(f"  {m.num_groups} groups x {m.group_size} samples in {m.num_shards} shards | engine {m.engine} | "
          f"model {m.model_path or '?'}")
    print(f"  sampling {m.sampling}")
    print(f"  reward mean {m.reward_mean:.4f} | all-correct groups {m.all_correct_fraction:.3f} | "
          f"all-wrong groups {m.all_wrong_fraction:.3f}")
    print(f"  truncation rate {m.truncation_rate:.3f} | mean response length {m.mean_response_length:.1f} | "
          f"T_rollout {m.t_rollout_s:.1f}s")

    tok_dir = args.tokenizer or m.model_path
    tokenizer = None
    if tok_dir:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        except (OSError, ValueError) as e:
            print(f"  (cannot load a tokenizer from {tok_dir}: {e}; showing token ids; pass --tokenizer)")
    rng = random.Random(args.seed)
    groups = rng.sample(range(ds.num_groups), min(args.num_samples, ds.num_groups))
    for g in groups:
        group = ds.group(g)
        s = rng.choice(group)
        rewards = " ".join(f"{x.reward:g}" for x in group)
        print(f"\n--- group {g} (prompt {s.prompt_id}) sample {s.sample_index}: reward {s.reward:g}, "
              f"advantage {s.advantage:+.3f}, {s.finish_reason}, {s.response_length} tokens | group rewards {rewards}")
        if tokenizer is None:
            print(f"prompt ids: {s.prompt_ids[-40:]}\nresponse ids: {s.response_ids[:80]}")
            continue
        prompt = tokenizer.decode(s.prompt_ids)
        print(f"[prompt] ...{prompt[-args.max_chars // 2:]}")
        print(f"[response] {tokenizer.decode(s.response_ids)[: args.max_chars]}")


if __name__ == "__main__":
    main()
