"""The plan's fixes (issue 49 item 7): named in the flags the launch wrote (slime's --max-tokens-per-gpu), and tried
beyond one flag: TP with SP, EP, --weight-sync disk, --offload-train, with the largest token budget at a layout, for
any --gpu-memory-gib (an H100's 80 GB too). Each fix named is applied to the launch and must then fit."""

import shlex
from dataclasses import replace

import pytest

from megamu.arguments import check_memory
from megamu.memory.memory_fixes import fits, fix_sets, fixes
from megamu.memory.memory_plan import plan_memory
from tests.memory.test_launch_plans import SLIME_QWEN3_4B, VERL_QWEN2_7B, launch
from tests.memory.test_moe_plan import _example as moe_example
from tests.memory.test_plan import grpo_7b


def remedies(tmp_path, monkeypatch, flags: str, hf: str, *extra: str) -> list[str]:
    """The fixes a launch's overflow names (its error), each as the flags to add."""
    plan = launch(tmp_path, monkeypatch, flags, hf, *extra)
    with pytest.raises(SystemExit) as e:
        check_memory(plan, [*shlex.split(flags), *extra])
    return str(e.value).split("Any one of these fits: ")[1].split("; ")


def with_flags(flags: str, remedy: str) -> list[str]:
    """``flags`` with each flag of ``remedy`` set to its value (replaced where the launch gave it, else added)."""
    words, new = shlex.split(flags), shlex.split(remedy)
    i = 0
    while i < len(new):
        flag = new[i]
        value = [new[i + 1]] if i + 1 < len(new) and not new[i + 1].startswith("--") else []
        if flag in words:
            at = words.index(flag)
            words[at + 1 : at + 1 + len(value)] = value
        else:
            words += [flag, *value]
        i += 1 + len(value)
    return words


def test_a_slime_launch_is_told_its_own_flag_and_each_fix_fits(tmp_path, monkeypatch):
    big = SLIME_QWEN3_4B.replace("--max-tokens-per-gpu 9216", "--max-tokens-per-gpu 200000")
    named = remedies(tmp_path, monkeypatch, big, "Qwen3-4B")
    assert named[0].startswith("--max-tokens-per-gpu ") and not any("--max-tokens-per-micro-batch" in r for r in named)
    assert any(r.startswith("--tensor-model-parallel-size 4 --sequence-parallel --max-tokens-per-gpu ") for r in named)
    for remedy in named:  # as written: no contradiction with the launch's own flag, and it fits
        words = with_flags(big, remedy)
        plan = launch(tmp_path, monkeypatch, shlex.join(words), "Qwen3-4B")
        check_memory(plan, words)


@pytest.mark.parametrize("gpu", ["h200", "h100", "80"])
def test_a_32b_model_at_tp1_is_named_a_layout_that_fits_on_any_card(tmp_path, monkeypatch, gpu):
    flags = VERL_QWEN2_7B.replace("--sglang-tp-size 2", "--sglang-tp-size 8")
    named = remedies(tmp_path, monkeypatch, flags, "Qwen2.5-32B", "--gpu-memory-gib", gpu)
    assert named and all(r.startswith("--tensor-model-parallel-size ") and "--sequence-parallel" in r for r in named)
    for remedy in named:
        words = with_flags(flags, remedy) + ["--gpu-memory-gib", gpu]
        check_memory(launch(tmp_path, monkeypatch, shlex.join(words), "Qwen2.5-32B"), words)


def test_a_push_that_overflows_is_fixed_by_a_disk_sync():
    """A colocated 7B run over 64 GPUs (TP 4 x DP 16, servers at TP 4, the trainer offloaded): an in-memory refresh
    gathers the full bf16 weights (14.2 GiB) on each pushing GPU, more than the trainer's sharded state; on a 20 GiB
    card only that phase overflows, and a disk sync (the servers reload an export) fits."""
    c = grpo_7b(weight_push="memory", tp=4, dp=16, server_tp=4, micro_batch_size=1, max_seq_len=1024,
                max_response_len=512, gpu_memory_gib=20.0)
    plan = plan_memory(c)
    assert [p for p in plan.phases() if plan.total(p) > 20 * 2**30] == ["push (colocated refresh)"]
    assert fixes(c) == [("weight_push", "disk")] and fix_sets(c) == [[("weight_push", "disk")]]
    assert fits(replace(c, weight_push="disk"))


def test_a_trainer_kept_on_the_gpu_is_told_to_offload():
    """The same run keeping its trainer state through the rollout (--no-offload-train): the servers' KV cache is
    sized while the trainer holds its weights and gradients, and the moments it adds later overflow the rollout."""
    c = grpo_7b(offload_train=False, tp=4, dp=16, server_tp=4, micro_batch_size=1, max_seq_len=1024,
                max_response_len=512, gpu_memory_gib=20.0)
    assert not fits(c) and ("offload_train", True) in fixes(c)
    assert fits(replace(c, offload_train=True))


def test_a_moe_model_is_named_more_expert_parallelism():
    c = moe_example(ep=2, dp=8)
    state = plan_memory(c).total("training")
    wider = plan_memory(replace(c, ep=4)).total("training")
    assert wider < state
    tight = replace(c, gpu_memory_gib=(state + wider) / 2 / 2**30)
    named = fix_sets(tight)
    assert [("ep", 4)] in named
    assert fits(replace(tight, ep=4))
    assert not any(("tp", 2) in f and ("sequence_parallel", True) not in f for f in named)  # MoE at TP > 1: SP


def test_the_plan_says_the_world_it_plans_for(tmp_path, monkeypatch):
    slime = launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B").table().splitlines()
    assert slime[1] == "world: 8 GPUs, 1 node(s) x 8 (from slime's --actor-num-nodes x --actor-num-gpus-per-node)"
    alone = SLIME_QWEN3_4B.replace("--actor-num-nodes 1 --actor-num-gpus-per-node 8 ", "").replace(
        "--tensor-model-parallel-size 2 ", "").replace("--rollout-num-gpus-per-engine 2 ", "")
    one = launch(tmp_path, monkeypatch, alone, "Qwen3-4B").table().splitlines()
    assert one[1].startswith("world: 1 GPU, 1 node(s) x 1 (no torchrun WORLD_SIZE and no --actor-num-nodes")
    from megamu.config.run_config import world_source

    monkeypatch.setenv("WORLD_SIZE", "16")
    assert world_source(16) == "from torchrun's WORLD_SIZE"


def test_experts_at_their_own_tp_are_named_more_expert_parallelism_than_dp():
    # slime's 30B-A3B layout on 8 GPUs, TP 4 + SP x DP 2, with experts at ETP 1 x EP 2 (expert-DP 4): megatron-core
    # folds the expert groups over the whole world apart from TP, so EP 4 and EP 8 exist though DP is 2
    c = moe_example(tp=4, sequence_parallel=True, dp=2, etp=1, ep=2)
    state = plan_memory(c).total("training")
    wider = plan_memory(replace(c, ep=4)).total("training")
    assert wider < state
    tight = replace(c, gpu_memory_gib=(state + wider) / 2 / 2**30)
    assert not fits(tight) and [("ep", 4)] in fix_sets(tight) and fits(replace(tight, ep=4))
    # at megatron's default ETP = TP 4 the expert groups are TP x EP x expert-DP: EP stops at DP 2
    default = moe_example(tp=4, sequence_parallel=True, dp=2, ep=2)
    assert not any(("ep", 4) in f for f in fix_sets(replace(default, gpu_memory_gib=1.0)))
