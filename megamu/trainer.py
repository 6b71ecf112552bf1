"""The parts of a μ-GRPO run that the stage loop in pretrain_mu_grpo.py strings together (DESIGN.md, paper §4).

Only this module knows every part: model and optimiser (Megatron side), converter (weight sync), rollout engine,
rewards, stage datasets and metrics. Rollout engines run on global rank 0; every rank reads the stage dataset.
"""

from __future__ import annotations

import json
import os
import random
import shlex
from dataclasses import replace
from pathlib import Path

import torch

from megamu import parallel
from megamu.algo import AlgoConfig
from megamu.arguments import BUILTIN_DATA
from megamu.atomic import atomic_write, atomic_write_text
from megamu.convert import export_hf, full_state_dict, load_hf_into_model
from megamu.convert.mapping import mcore_to_hf_tensors
from megamu.data.prompts import stop_token_ids
from megamu.metrics import MetricsLogger, read_metrics
from megamu.model import ModelArch, build_model
from megamu.rollout.dataset import StageDataset
from megamu.rollout.types import SamplingParams
from megamu.training.checkpoint import load_checkpoint, save_checkpoint
from megamu.training.optimizer import OptimizerConfig, build_optimizer
from megamu.training.step import compute_logprobs, train_step


def default_transformer_impl() -> str:
    """The one place the layer implementation follows the device: TE kernels on GPU, local spec on CPU."""
    return "transformer_engine" if torch.cuda.is_available() else "local"


def resolve_hf_checkpoint(path: str | None) -> Path:
    if path is None:
        from megamu.demo_model import smollm2_hf_dir

        return smollm2_hf_dir()
    return Path(path)  # validated by megamu.arguments


class Run:
    """State of one run: model, optimiser, prompts, progress (stage, update) and metrics."""

    def __init__(self, args, algo: AlgoConfig, plan):
        self.args, self.algo, self.plan = args, algo, plan
        self.save = Path(args.save)
        self.hf_source = resolve_hf_checkpoint(args.hf_checkpoint)
        self.arch = ModelArch.from_hf(self.hf_source)
        impl = args.transformer_impl or default_transformer_impl()
        if args.bf16 and not torch.cuda.is_available():
            raise SystemExit("pretrain_mu_grpo.py: error: --bf16: needs a GPU (the CPU optimiser keeps no fp32 master "
                             "weights, so CPU runs train in fp32)")
        self.model = build_model(self.arch, transformer_impl=impl, bf16=args.bf16)
        self.optimizer = build_optimizer(self.model, OptimizerConfig(
            lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps, clip_grad=args.clip_grad, lr_warmup_iters=args.lr_warmup_iters))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.hf_source)
        self.train_prompts, self.eval_prompts = self._load_prompts()
        self.engine = None  # alive across stages only in colocated mode (rank 0)
        self.engine_warm = False  # known on every rank: whether rank 0's colocated engine is up
        self.scorer = None

        extra = load_checkpoint(args.load, self.model, self.arch, self.optimizer) if Path(args.load).exists() else None
        if extra is None:
            load_hf_into_model(self.model, self.arch, self.hf_source)
            self.stage, self.update_in_stage, elapsed = 0, 0, 0.0
        else:
            self.stage, self.update_in_stage, elapsed = extra["stage"], extra["update_in_stage"], extra["elapsed"]
            if self.update_in_stage >= plan.mu:
                self.stage, self.update_in_stage = self.stage + 1, 0
            _print(f"resumed from {args.load}: stage {self.stage}, update {self.update_in_stage} of {plan.mu}")
        self.metrics = MetricsLogger(args.save, args.tensorboard_dir, enabled=parallel.is_main_rank(),
                                     elapsed_offset=elapsed)
        self.metrics.truncate(stage=self.stage, update=self.global_update)

    @property
    def global_update(self) -> int:
        return self.stage * self.plan.mu + self.update_in_stage

    # ---------------------------------------------------------------- prompts
    def _load_prompts(self):
        from megamu.data.arithmetic import DEMO_FEW_SHOT, DEMO_INSTRUCTION, addition_problems
        from megamu.data.prompts import DEFAULT_INSTRUCTION, load_prompts

        args = self.args
        files, instruction, few_shot = args.prompt_data.split(","), DEFAULT_INSTRUCTION, ()
        if args.prompt_data == BUILTIN_DATA:
            # Written next to the run so the data a run trained on can be inspected later.
            n = self.plan.num_stages * self.plan.prompts_per_stage + args.eval_prompts
            path = self.save / "data" / "addition.jsonl"
            if parallel.is_main_rank() and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in addition_problems(n, seed=args.seed)))
            parallel.barrier()
            files, instruction, few_shot = [str(path)], DEMO_INSTRUCTION, DEMO_FEW_SHOT
        prompts = load_prompts(files, self.tokenizer, prompt_key=args.prompt_key, answer_key=args.answer_key,
                               max_prompt_length=args.max_prompt_length, skip_bad_rows=args.skip_bad_rows,
                               instruction=instruction, few_shot=few_shot)
        order = list(range(len(prompts)))
        random.Random(args.seed).shuffle(order)
        n_eval = min(args.eval_prompts, len(prompts) // 2)
        held_out = [prompts[i] for i in order[:n_eval]]
        train = [prompts[i] for i in order[n_eval:]]
        if not train:
            raise SystemExit("pretrain_mu_grpo.py: error: --prompt-data: no usable prompts")
        return train, held_out

    def stage_prompts(self, stage: int):
        """B_train prompts for ``stage``: consecutive slices of a seeded order, reshuffled at each epoch."""
        picked = stage_prompt_indices(len(self.train_prompts), self.plan.prompts_per_stage, stage, self.args.seed)
        return [replace(self.train_prompts[i], prompt_id=j) for j, i in enumerate(picked)]

    # ---------------------------------------------------------------- phases
    def export_policy(self, name: str) -> Path | None:
        """Freeze θ as an HF folder (atomic; identical weights give an identical folder, so reuse a finished one).

        A colocated in-process engine takes the weights in memory instead, so no folder is written for it."""
        if name.startswith("stage_") and self._push_in_memory():
            return None
        out = self.save / "hf" / name
        if not (out / "config.json").exists():
            export_hf(self.model, self.arch, out, hf_source_dir=self.hf_source)
        parallel.barrier()
        return out

    def sampling(self, stage: int) -> SamplingParams:
        a = self.args
        return SamplingParams(temperature=a.rollout_temperature, top_p=a.rollout_top_p,
                              max_new_tokens=a.rollout_max_response_len, seed=a.seed + stage,
                              stop_token_ids=stop_token_ids(self.tokenizer))

    def _push_in_memory(self) -> bool:
        """Colocated mode with the in-process engine already running (rank 0): weights go over as a state dict."""
        return self.engine_warm and self.args.rollout_mode == "colocated" and self.args.rollout_engine == "local"

    def _engine_for(self, hf_dir: Path | None, weights: dict | None = None):
        from megamu.reward.pool import RewardScorer
        from megamu.rollout import make_engine

        if self.scorer is None:
            self.scorer = RewardScorer(self.args.reward_fn) if self.args.reward_fn else RewardScorer()
        if self.engine is not None:  # colocated: the engine stays up, new weights are pushed in place
            if weights is not None:
                self.engine.update_weights(state_dict=weights)
            else:
                self.engine.update_weights(hf_dir=str(hf_dir))
            return self.engine
        a = self.args
        if a.rollout_engine == "local":
            return make_engine("local", str(hf_dir), max_batch_size=a.rollout_batch_size)
        urls = a.sglang_url.split(",") if a.sglang_url else None
        engine = make_engine("sglang", str(hf_dir), urls=urls, num_servers=a.sglang_num_servers,
                             tp_size=a.sglang_tp_size, extra_server_args=shlex.split(a.sglang_server_args))
        if urls:  # servers we did not start still hold the previous stage's weights
            engine.update_weights(hf_dir=str(hf_dir))
        return engine

    def rollout(self, stage: int, hf_dir: Path | None) -> StageDataset:
        """β_k generates D_k = {(x, y, A, b_1:T)} on rank 0 (durable, resumable); every rank then reads it.

        Every rank first returns its cached-but-free GPU memory, so the engine gets it (§4); see release_gpu_cache."""
        from megamu.rollout.phase import run_rollout_phase

        out = self.save / "rollouts" / f"stage_{stage}"
        parallel.barrier()  # every rank sees the same manifest state
        if not (out / "manifest.json").exists():
            # the gather is collective: every TP rank takes part, rank 0 keeps the result
            weights = dict(mcore_to_hf_tensors(self.arch, full_state_dict(self.model, self.arch))) \
                if self._push_in_memory() else None
            release_gpu_cache()
            if parallel.is_main_rank():
                engine = self._engine_for(hf_dir, weights)
                run_rollout_phase(engine, self.stage_prompts(stage), out, sampling=self.sampling(stage),
                                  n_samples=self.plan.n_samples_per_prompt, scorer=self.scorer,
                                  tokenizer=self.tokenizer, stage=stage, policy_version=stage,
                                  groups_per_shard=self.args.rollout_groups_per_shard,
                                  shards_per_call=self.args.rollout_shards_per_call,
                                  model_path=str(hf_dir or ""))
                if stage == 0 and self.eval_prompts:
                    self.evaluate(engine, stage=0, label="base")
                self._release(engine)
            parallel.barrier()
            self.engine_warm = self.args.rollout_mode == "colocated"
        return StageDataset(out)

    def _release(self, engine) -> None:
        if self.args.rollout_mode == "colocated":
            self.engine = engine
        else:
            engine.shutdown()  # the engine's memory is free for the optimisation phase (§4, Phase 1)

    def optimise(self, stage: int, dataset: StageDataset) -> None:
        """μ updates on the static dataset D_k; checkpoints every --save-interval updates and at the stage end."""
        from tqdm import tqdm

        a, mu = self.args, self.plan.mu
        batches = dataset.minibatches(self.plan.prompts_per_update, seed=a.seed + stage,
                                      start_update=self.update_in_stage, num_updates=mu)
        recompute = a.behaviour_logprobs == "recompute"
        if recompute:
            anchors = self._recompute_anchors(stage, dataset)
        bar = tqdm(total=mu, initial=self.update_in_stage, desc=f"optimise stage {stage}", unit="update",
                   disable=not parallel.is_main_rank(), dynamic_ncols=True)
        for samples in batches:
            if recompute:
                samples = [replace(s, behaviour_logprobs=anchors[(s.prompt_id, s.sample_index)]) for s in samples]
            stats = train_step(self.model, self.optimizer, samples, self.algo, micro_batch_size=a.micro_batch_size,
                               max_tokens_per_micro_batch=a.max_tokens_per_micro_batch,
                               temperature=a.rollout_temperature, skip_zero_advantage=a.skip_zero_advantage)
            self.update_in_stage += 1
            if self.update_in_stage % a.log_interval == 0 or self.update_in_stage == mu:
                self.metrics.log("update", step=self.global_update, stage=stage, update=self.global_update - 1, **stats)
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.4f}", reward=f"{stats['reward_mean']:.2f}",
                            ratio=f"{stats['ratio_mean']:.3f}", veto=f"{stats['veto_token_fraction']:.3f}")
            if self.update_in_stage == mu or (a.save_interval and self.update_in_stage % a.save_interval == 0):
                self.checkpoint(stage)
            if a.hf_export_interval and self.global_update % a.hf_export_interval == 0:
                self.export_policy(f"iter_{self.global_update:07d}")  # for evaluate.py --run
            crash_point("update", self.global_update)
        bar.close()
        self.stage, self.update_in_stage = stage + 1, 0

    def _recompute_anchors(self, stage: int, dataset: StageDataset) -> dict:
        """--behaviour-logprobs recompute: b_t = the trainer's log π_θk at stage start (cached beside the dataset)."""
        cache = self.save / "rollouts" / f"stage_{stage}" / "recomputed_logprobs.pt"
        if cache.exists():
            return torch.load(cache)
        samples = dataset.samples()
        values = compute_logprobs(self.model, samples, temperature=self.args.rollout_temperature,
                                  micro_batch_size=self.args.micro_batch_size)
        anchors = {(s.prompt_id, s.sample_index): v for s, v in zip(samples, values)}
        if parallel.is_main_rank():
            atomic_write(cache, lambda tmp: torch.save(anchors, tmp))
        parallel.barrier()
        return anchors

    def log_stage(self, stage: int, dataset: StageDataset, **times: float) -> None:
        m = dataset.manifest
        self.metrics.log("stage", step=stage, stage=stage, **times, reward_mean=m.reward_mean,
                               truncation_rate=m.truncation_rate, all_correct_fraction=m.all_correct_fraction,
                               all_wrong_fraction=m.all_wrong_fraction, mean_response_length=m.mean_response_length)
        _print(f"[stage {stage}] rollout reward {m.reward_mean:.3f}  export {times['t_export']:.1f}s  "
               f"rollout {times['t_rollout']:.1f}s  train {times['t_train']:.1f}s")
        crash_point("stage", stage)

    def summary(self) -> None:
        """The final table: per-stage rollout reward and timings, then the held-out evaluation."""
        if not parallel.is_main_rank():
            return
        rows = read_metrics(self.save)
        stages = [r for r in rows if r["kind"] == "stage"]
        evals = [r for r in rows if r["kind"] == "eval"]
        print("\n stage | rollout reward | all-correct | all-wrong | trunc. | t_export | t_rollout | t_train")
        for r in stages:
            print(f" {r['stage']:>5} | {r['reward_mean']:>14.3f} | {r['all_correct_fraction']:>11.2f} | "
                  f"{r['all_wrong_fraction']:>9.2f} | {r['truncation_rate']:>6.2f} | {r['t_export']:>7.1f}s |"
                  f" {r['t_rollout']:>8.1f}s | {r['t_train']:>6.1f}s")
        for r in evals:
            print(f" held-out greedy accuracy ({r['label']}): {r['accuracy']:.3f} on {r['n']} prompts")
        run = [r for r in rows if r["kind"] == "run"]
        if run:
            last = run[-1]
            print(f" total {last['t_total']:.1f}s, {last['total_updates']} updates; metrics in {self.metrics.path}")

    def checkpoint(self, stage: int) -> None:
        save_checkpoint(self.args.save, self.global_update, self.model, self.arch, self.optimizer,
                        extra={"stage": stage, "update_in_stage": self.update_in_stage,
                               "elapsed": self.metrics.elapsed(), "plan": vars(self.plan)})

    def evaluate(self, engine, *, stage: int, label: str) -> float:
        """Greedy accuracy on the held-out prompts (the demo's before/after number)."""
        from megamu.rollout.phase import generate_groups

        greedy = replace(self.sampling(stage), temperature=1.0, top_k=1, seed=0)
        groups = generate_groups(engine, self.eval_prompts, greedy, 1, self.scorer, self.tokenizer, stage=stage)
        acc = sum(g[0].reward for g in groups) / max(len(groups), 1)
        self.metrics.log("eval", stage=stage, label=label, accuracy=acc, n=len(groups))
        _print(f"[eval] {label}: greedy accuracy {acc:.3f} on {len(groups)} held-out prompts")
        return acc

    def finish(self) -> Path:
        """Export the final policy and, on rank 0, measure its held-out greedy accuracy."""
        final = self.export_policy("final")
        if parallel.is_main_rank() and self.eval_prompts:
            engine = self._engine_for(final)
            self.evaluate(engine, stage=self.plan.num_stages, label="final")
            self.engine = engine
        if self.engine is not None:
            self.engine.shutdown()
        if self.scorer is not None:
            self.scorer.close()
        self.metrics.log("run", t_total=self.metrics.elapsed(), total_updates=self.global_update)
        self.metrics.close()
        return final


def release_gpu_cache() -> None:
    """Before the engine generates, the trainer gives back the GPU memory it does not need (§4 System-Level Efficiency).

    Only the caching allocator's free blocks are released. Moving parameters and optimiser state off the device is
    not done: under megatron DDP the parameters are views into contiguous buffers that a plain ``.cpu()`` would
    detach from the optimiser, silently. Size SGLang's --mem-fraction-static to what the trainer keeps resident.
    """
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stage_prompt_indices(n: int, per_stage: int, stage: int, seed: int) -> list[int]:
    """Indices of stage ``stage``'s prompts: consecutive slices of a stream of seeded permutations of range(n), one
    per epoch, so every prompt is used once per epoch and stages never depend on how many ran before."""
    orders: dict[int, list[int]] = {}
    picked = []
    for pos in range(stage * per_stage, (stage + 1) * per_stage):
        epoch, i = divmod(pos, n)
        if epoch not in orders:
            orders[epoch] = list(range(n))
            random.Random(seed * 1000 + epoch).shuffle(orders[epoch])
        picked.append(orders[epoch][i])
    return picked


def crash_point(kind: str, index: int) -> None:
    """Test hook: MEGAMU_CRASH_AFTER=kind:index ends the process abruptly there (no cleanup), like a kill."""
    if os.environ.get("MEGAMU_CRASH_AFTER") == f"{kind}:{index}":
        os._exit(17)


def _print(msg: str) -> None:
    if parallel.is_main_rank():
        print(msg, flush=True)

