"""The run's prompts: loading (files or the demo's built-in task), the held-out split, each stage's B_train prompts."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from megamu.config_fields import derived, flag
from megamu.data.arithmetic import DEMO_FEW_SHOT, DEMO_INSTRUCTION, addition_problems
from megamu.data.order import epoch_stream
from megamu.data.prompts import DEFAULT_INSTRUCTION, PromptDataError, PromptRecord, load_prompts
from megamu.errors import ConfigError, check_non_negative, check_positive
from megamu.runtime import parallel
from megamu.runtime.atomic import atomic_write_text

HELD_OUT = "held-out"  # the evaluation set split off the training prompts (--eval-prompts)


PROMPT_SETTINGS = "prompt_settings.json"  # under the run's data dir: how the run built its prompts

@dataclass(frozen=True)
class PromptsConfig:
    """``files`` empty: the demo's built-in task, ``builtin_rows`` seeded two-digit additions written to
    ``data_dir/addition.jsonl`` (so the data a run trained on can be inspected later).

    The fields marked "derived" are the run's: None here, RunConfig.derive passes them down (and refuses a copy that
    differs from the run's own); prompts on their own are given them."""

    files: tuple[str, ...] = derived("--prompt-data", default=())  # FILE[,FILE...]; none: the built-in task
    # B_train of a staged plan (μ x B_mini, or the flag's value); None in async mode (no stages)
    prompts_per_stage: int | None = derived("--prompts-per-stage")
    # prompts kept out of training for the greedy evaluation (at most half the data)
    held_out: int = flag("--eval-prompts", type=int, default=100,
                         help="training prompts held out as the 'held-out' evaluation set (0: none)")
    seed: int | None = derived("seed")
    data_dir: Path | None = derived("policy.checkpoint.save")  # megamu.run.run_dir.RunDir(save).data
    # without files: enough rows for the run and the held-out split
    builtin_rows: int | None = derived("--prompt-data")
    prompt_key: str = flag("--prompt-key", "--input-key", default="problem", help=(
        "the problem's column: text, or chat messages (slime's --input-key); verl's 'prompt' messages are read when "
        "this column is absent"))
    # None: the key the run's reward reads ("tests" for --reward code, else "answer"; RunConfig.derive); on its own:
    # "answer"
    answer_key: str | None = flag("--answer-key", "--label-key", default=None, help=(
        "the answer's column, a dotted key reaching into a struct (slime's --label-key; default: 'answer', or "
        "'tests' with --reward code; verl's reward_model.ground_truth when absent)"))
    max_prompt_length: int = flag("--max-prompt-length", default=1024, type=int)
    skip_bad_rows: bool = flag("--skip-bad-rows", default=False, action="store_true")
    # the model's (max_position_embeddings of --hf-checkpoint's config.json): prompt + reply must fit it
    context_length: int | None = derived("policy.hf_checkpoint")
    max_response_len: int | None = derived("plan.max_response_len")
    instruction: str | None = flag("--instruction", default=None, help=(  # None: the paper's; "": none
        "text appended to each text problem (default: the paper's step-by-step \\boxed{} instruction; '' for none); "
        "message rows carry their own"))
    chat_template: bool | None = flag("--apply-chat-template", default=None, action="optional_bool", help=(
        "render prompts through the tokenizer's chat template (default: when it has one)"))
    # (name, file) of held-out sets evaluated beside the split-off one: the flag's NAME PATH pairs
    eval_sets: tuple[tuple[str, str], ...] = derived("--eval-prompt-data", default=())

    def __post_init__(self):
        check_positive(self, "prompts_per_stage", "max_prompt_length")
        check_non_negative(self, "held_out", "builtin_rows")
        if not self.files and self.builtin_rows == 0:
            raise ConfigError("builtin_rows", "no prompt files and no built-in rows: nothing to train on")


class Prompts:
    def __init__(self, cfg: PromptsConfig, tokenizer):
        self.cfg = cfg
        files, instruction, few_shot = list(cfg.files), DEFAULT_INSTRUCTION, ()
        if not files:
            files, instruction, few_shot = [str(self._write_builtin())], DEMO_INSTRUCTION, DEMO_FEW_SHOT
        if cfg.instruction is not None:
            instruction = cfg.instruction

        if parallel.is_main_rank():  # what tools/evaluate.py --run builds its prompts with
            settings = {"prompt_key": cfg.prompt_key, "answer_key": cfg.answer_key or "answer",
                        "instruction": instruction,
                        "few_shot": [list(pair) for pair in few_shot], "chat_template": cfg.chat_template,
                        "max_prompt_length": cfg.max_prompt_length, "skip_bad_rows": cfg.skip_bad_rows,
                        "max_response_len": cfg.max_response_len}
            cfg.data_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cfg.data_dir / PROMPT_SETTINGS, json.dumps(settings, indent=1) + "\n")

        def load(paths: list[str]) -> list[PromptRecord]:  # training and evaluation prompts are built alike
            return load_prompts(paths, tokenizer, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key or "answer",
                                max_prompt_length=cfg.max_prompt_length, skip_bad_rows=cfg.skip_bad_rows,
                                instruction=instruction, few_shot=few_shot, context_length=cfg.context_length,
                                max_response_len=cfg.max_response_len or 0, chat_template=cfg.chat_template)

        prompts = load(files)
        order = list(range(len(prompts)))
        random.Random(cfg.seed).shuffle(order)
        n_held_out = min(cfg.held_out, len(prompts) // 2)
        self.held_out: list[PromptRecord] = [prompts[i] for i in order[:n_held_out]]
        self.train: list[PromptRecord] = [prompts[i] for i in order[n_held_out:]]
        if not self.train:
            raise PromptDataError(f"no training prompts left in {files} after holding out {n_held_out}")
        # what every evaluation runs on: the split-off held-out prompts, then the named sets (--eval-prompt-data)
        self.eval_sets: dict[str, list[PromptRecord]] = {HELD_OUT: self.held_out} if self.held_out else {}
        self.eval_sets.update((name, load([path])) for name, path in cfg.eval_sets)

    def _write_builtin(self) -> Path:
        path = self.cfg.data_dir / "addition.jsonl"
        if parallel.is_main_rank() and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            rows = addition_problems(self.cfg.builtin_rows, seed=self.cfg.seed)
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
        parallel.wait_for_main_rank()
        return path

    def for_stage(self, stage: int) -> list[PromptRecord]:
        """B_train prompts of ``stage`` (prompt ids 0..B_train-1): consecutive slices of the epoch stream."""
        per = self.cfg.prompts_per_stage
        picked = epoch_stream(len(self.train), self.cfg.seed, stage * per, per)
        return [replace(self.train[i], prompt_id=j) for j, i in enumerate(picked)]

    def for_sampling_round(self, stage: int, round_: int, per_round: int | None = None) -> list[PromptRecord]:
        """Dynamic sampling's generation round ``round_`` of ``stage``, ``per_round`` prompts (verl's
        data.gen_batch_size; None: B_train). Round 0 is the stage's own B_train prompts, then per_round - B_train
        drawn from a shuffle of round 0's own; a refill round r draws per_round prompts from a shuffle of its own
        (seeded by the run's seed, the stage and r), so the stages' stream, and with it every later stage, stays
        what it is. Prompt ids r·per_round + j: each request's seed (derived from the prompt id) differs from every
        other round's."""
        per = per_round or self.cfg.prompts_per_stage
        if per < self.cfg.prompts_per_stage:
            raise ValueError(f"a sampling round of {per} prompts is smaller than the stage's "
                             f"{self.cfg.prompts_per_stage}")
        own = self.for_stage(stage) if round_ == 0 else []
        picked = epoch_stream(len(self.train), f"{self.cfg.seed}/refill/{stage}/{round_}", 0, per - len(own))
        return own + [replace(self.train[i], prompt_id=round_ * per + len(own) + j) for j, i in enumerate(picked)]
