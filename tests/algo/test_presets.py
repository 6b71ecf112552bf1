"""The presets are built one way (``AlgoConfig.preset``) and are the paper's settings (arXiv 2605.17570 App. B.1)."""

from __future__ import annotations

import pytest

from megamu.algo import ALGORITHM_PRESETS, AlgoConfig
from megamu.errors import ConfigError


def test_a_config_named_for_a_method_cannot_silently_be_another():
    with pytest.raises(TypeError):  # the rule's own settings have no defaults: no "mu-grpo" that is plain GRPO
        AlgoConfig("mu-grpo")
    with pytest.raises(ConfigError) as e:
        AlgoConfig.preset("ppo")
    assert e.value.field == "name"


def test_mu_grpo_is_the_papers_rule():
    """§4's J_μ-GRPO: clip(ρ, 0, 5) and the S_seq veto at τ_c = 10^-4 (App. B.1); GRPO: ε = 0.2 (§5)."""
    mu = AlgoConfig.preset("mu-grpo")
    assert (1 - mu.clip_low, 1 + mu.clip_high) == (0.0, 5.0)
    assert (mu.veto_threshold, mu.veto_scope, mu.m2po_threshold) == (1e-4, "sequence", None)
    grpo = AlgoConfig.preset("grpo")
    assert (1 - grpo.clip_low, 1 + grpo.clip_high, grpo.veto_threshold) == (0.8, 1.2, None)
    assert AlgoConfig.preset("m2po").m2po_threshold == 0.04 and AlgoConfig.preset("m2po").clip_high is None
    assert not any(a.uses_reference or a.entropy_coef for a in ALGORITHM_PRESETS.values())  # no KL, no entropy term


def test_overrides_apply_on_top_of_the_preset_none_included():
    a = AlgoConfig.preset("mu-grpo", clip_high=None, veto_scope="suffix")
    assert (a.name, a.clip_low, a.clip_high, a.veto_scope, a.veto_threshold) == ("mu-grpo", 1.0, None, "suffix", 1e-4)
    assert AlgoConfig.preset("grpo") == ALGORITHM_PRESETS["grpo"]
    with pytest.raises(TypeError):
        ALGORITHM_PRESETS["grpo"] = a  # read-only
