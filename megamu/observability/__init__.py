"""What a run reports: metric records and their JSONL sink (``metrics``) and the experiment trackers, wandb and
tensorboard (``tracking``). Nothing here decides anything of the run."""
