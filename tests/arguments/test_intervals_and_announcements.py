"""No flag means something else than in slime, verl or Megatron-LM: intervals count optimiser updates (Megatron-LM's
iterations) unless --interval-unit rollouts asks for slime's and verl's count (slime train.py: save/eval every N
rollouts; verl trainer.save_freq / test_freq: every N training steps, one per rollout batch), and a launch in slime's
terms at μ > 1 must say which; defaults that differ from verl's are announced at start."""

import pytest

from megamu.arguments import parse_args

# slime's terms: 32 prompts x 8 samples per rollout, 64 samples per update: μ = 4 updates per rollout
SLIME = ["--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--global-batch-size", "64", "--num-rollout",
         "10"]


def cfg(tmp_path, *flags):
    return parse_args(["--save", str(tmp_path / "run"), *flags])


@pytest.mark.parametrize("flag", ["--save-interval", "--eval-interval", "--hf-export-interval"])
def test_a_slime_launch_at_mu_above_one_must_say_what_its_interval_counts(tmp_path, flag):
    with pytest.raises(SystemExit) as e:
        cfg(tmp_path, *SLIME, flag, "20")
    message = str(e.value)
    assert f"{flag}: 20 is ambiguous here" in message and "each rollout is μ = 4 updates" in message
    assert "--interval-unit rollouts for slime's meaning (every 20 rollouts = 80 updates)" in message


def test_rollouts_are_converted_to_updates(tmp_path):
    run = cfg(tmp_path, *SLIME, "--save-interval", "2", "--eval-interval", "3", "--interval-unit", "rollouts")
    assert run.plan.mu == 4 and (run.save_interval, run.evaluation.eval_interval) == (8, 12)
    updates = cfg(tmp_path, *SLIME, "--save-interval", "2", "--interval-unit", "updates")
    assert updates.save_interval == 2


def test_where_a_rollout_is_one_update_both_counts_agree(tmp_path):
    """slime's run-qwen3-4B.sh: 32 x 8 samples per rollout, --global-batch-size 256: μ = 1."""
    run = cfg(tmp_path, "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--global-batch-size", "256",
              "--num-rollout", "3", "--save-interval", "2")
    assert (run.plan.mu, run.save_interval) == (1, 2)


def test_megatron_style_launches_count_updates(tmp_path):
    run = cfg(tmp_path, "--num-stages", "2", "--prompts-per-stage", "16", "--prompts-per-update", "4",
              "--save-interval", "2")
    assert (run.plan.mu, run.save_interval) == (4, 2)


def test_async_mode_has_no_rollouts_to_count(tmp_path):
    with pytest.raises(SystemExit, match="--interval-unit: rollouts: async mode"):
        cfg(tmp_path, "--rollout-mode", "async", "--train-iters", "8", "--weight-sync-interval", "4",
            "--max-policy-lag", "8", "--save-interval", "2", "--interval-unit", "rollouts")


def test_defaults_a_verl_user_would_not_assume_are_announced(tmp_path, capsys):
    cfg(tmp_path, "--num-stages", "2", "--save-interval", "4")
    out = capsys.readouterr().out
    # verl's actor.loss_agg_mode default is token-mean; μ-GRPO's clip range is not their [0.8, 1.2]
    assert "note: loss aggregation: seq-mean-token-mean" in out and "--loss-aggregation token-mean" in out
    assert "note: ratio clip: [0, 5] (mu-grpo)" in out
    assert "count optimiser updates, every 4" in out and "--interval-unit rollouts" in out
    cfg(tmp_path, "--num-stages", "2", "--algorithm", "grpo", "--loss-aggregation", "token-mean")
    assert "note: loss aggregation" not in capsys.readouterr().out  # verl's own settings: nothing to announce


def test_evaluation_replies_get_eval_max_response_len(monkeypatch, tmp_path):
    """slime's --eval-max-response-len: evaluation replies may be longer than rollout's (16384 vs 8192 in
    run-qwen3-4B.sh); without it they get the rollout's length."""
    from megamu.config.loop_config import EvalConfig
    from megamu.engines.types import SamplingParams
    from megamu.evaluation import heldout
    from megamu.observability.metrics import MetricsLogger

    asked = []

    def groups(engine, prompts, sampling, k, *rest, **kw):  # what the engine was asked for, then one scored reply
        asked.append((sampling.max_new_tokens, k))
        return [[type("S", (), {"reward": 1.0})()] * k for _ in prompts]

    monkeypatch.setattr(heldout, "generate_groups", groups)
    metrics = MetricsLogger(str(tmp_path), None, enabled=False)
    rollout = SamplingParams(max_new_tokens=8192)
    for cfg, want in ((EvalConfig(eval_max_response_len=16384, n_samples_per_eval_prompt=2), 16384),
                      (EvalConfig(n_samples_per_eval_prompt=2), 8192)):
        asked.clear()
        heldout.evaluate_sets(None, {"aime": [object()]}, rollout, cfg, None, None, metrics, stage=0, update=0,
                              label="start")
        assert asked == [(want, 1), (want, 2)]  # greedy, then k sampled
