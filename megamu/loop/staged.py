"""The staged loop (μ-GRPO, paper §4) and its colocated variant (the fair standard-GRPO baseline).

Each stage k: θ_k is published to the engine as β_k, the trainer offloads, rank 0's engine generates the static
dataset D_k, the trainer onloads, the stage's HF export is pruned, and μ updates run on D_k. The two modes differ only
in how the weights reach the engine (``StageEngine.wants``):
- staged: every stage exports θ_k as an HF folder, starts an engine on it, and stops the engine after D_k is written,
  so its memory is free for the μ updates;
- colocated: the engine starts once from a folder and stays up; later stages push the new weights into it, in memory
  (the local engine; SGLang with --weight-sync memory) or from a folder (SGLang with --weight-sync disk). Each SGLang
  push is checked (layout, weight version, a teacher-forced log-prob probe) and logged as a "sync" record. Servers
  on the trainer's GPUs (--sglang-memory-saver, the default on GPUs) give their memory back while the trainer trains
  and take it again around the push (megamu.engines.sglang.memory).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from megamu import parallel
from megamu.data.prompts import PromptRecord, stop_token_ids
from megamu.data.stage_prompts import HELD_OUT
from megamu.engines import Engine, EngineConfig, build_engine
from megamu.engines.sglang import memory
from megamu.loop.heldout import EvalConfig, evaluate_sets
from megamu.metrics import MetricsLogger
from megamu.rollout import RolloutConfig
from megamu.rollout.dataset import StageDataset
from megamu.rollout.phase import run_rollout_phase
from megamu.run_dir import RunDir
from megamu.weights import Weights

STAGED_MODES = ("staged", "colocated")
PROBE_TOKENS = 32  # tokens of the first held-out prompt whose log-probs check each SGLang push


@dataclass(frozen=True)
class WeightRequest:
    """What the engine takes next: an HF folder to start (or reload) from, HF-named tensors to push, and whether a
    log-prob probe must check the push."""

    folder: bool
    tensors: bool = False
    every_node: bool = False  # the tensors on each node's local rank 0, which pushes them to its own servers
    probe_ids: list[int] | None = None


class StageEngine:
    """Rank 0's engine through the stages (other ranks keep only what every rank must agree on: ``warm``)."""

    def __init__(self, mode: str, engine: EngineConfig, rollout: RolloutConfig, run_dir: RunDir, tokenizer,
                 metrics: MetricsLogger, held_out: list[PromptRecord],
                 eval_sets: dict[str, list[PromptRecord]] | None = None, evaluation: EvalConfig | None = None):
        if mode not in STAGED_MODES:
            raise ValueError(f"StageEngine runs the {STAGED_MODES} modes, not {mode!r}")
        self.mode, self.engine_cfg, self.cfg, self.run_dir = mode, engine, rollout, run_dir
        self.tokenizer, self.metrics, self.held_out = tokenizer, metrics, held_out
        self.eval_sets = {HELD_OUT: held_out} if eval_sets is None and held_out else (eval_sets or {})
        self.evaluation = evaluation or EvalConfig()
        self.engine: Engine | None = None  # rank 0 only
        self.node = None  # SGLang on several ranks (``spread``): this node's servers, on its local rank 0 (nodes.py)
        self.scorer = None  # rank 0 only, created with the first engine
        self.hf_dir: Path | None = None  # the folder the next engine starts from
        self.warm = False  # every rank: whether rank 0's engine stays up between stages (colocated, after stage 0)
        # colocated servers that take turns with the trainer for the GPU's memory; what they have released now
        self.saves_memory = mode == "colocated" and engine.kind == "sglang" and engine.sglang.memory_saver
        self.released: tuple[str, ...] = ()
        self.report = None  # (stage, SyncReport) of the last push, logged once its probe is checked
        self.pending = None  # the probe of a push into servers that released their KV cache, checked by wake()
        self.t_eval = 0.0  # seconds of this process's last held-out evaluation (rank 0), for the run's ETA
        self.launch_stage: int | None = None  # colocated servers megamu launched: the stage whose export they loaded
        if parallel.is_main_rank():  # no engine is up yet: what a killed run kept for one goes now
            run_dir.prune_done_stage_exports()

    def sampling(self, stage: int):
        return self.cfg.sampling(stage, stop_token_ids(self.tokenizer))

    def wants(self) -> WeightRequest:
        """Staged, or the first colocated stage: a folder. Later colocated stages: tensors for the local engine and
        for SGLang's memory sync (probed), a folder for SGLang's disk sync (probed)."""
        if not self.warm:
            return WeightRequest(folder=True)
        if self.engine_cfg.kind == "local":
            return WeightRequest(folder=False, tensors=True)
        probe = self.held_out[0].prompt_ids[:PROBE_TOKENS] if self.held_out else None
        memory = self.engine_cfg.sglang.weight_sync == "memory"
        return WeightRequest(folder=not memory, tensors=memory, every_node=memory and self.pushes_per_node(),
                             probe_ids=probe)

    def pushes_per_node(self) -> bool:
        """In-memory pushes as tensors (servers on the trainer's GPUs) on several nodes: the CUDA IPC handles open
        only on their own host, so each node pushes to its own servers (slime's colocated update does the same). A
        broadcast (servers on GPUs of their own, or gloo) goes from rank 0 to every node's servers in one group."""
        from megamu.engines.sglang.tensor_sync import transport

        sglang = self.engine_cfg.sglang
        return self.spread() and transport(sglang.shares_trainer_devices, sglang.sync_backend) == "tensor"

    def load(self, weights: Weights, stage: int) -> None:
        """β_k's weights: the folder the next engine starts from, or a push into the running engine (rank 0; each
        node's local rank 0 for per-node pushes)."""
        self.hf_dir = weights.hf_dir or self.hf_dir  # the folder the stage's manifest names as its model
        if self.warm and self.wants().every_node:  # the same on every rank: all take part
            return self._push_per_node(weights, stage)
        if not self.warm or not parallel.is_main_rank():
            return
        self._resume(memory.WEIGHTS)  # the push lands in the servers' own weight memory
        # servers without their KV cache cannot run the probe: it waits for wake()
        probe, self.pending = (None, weights.probe) if self.released else (weights.probe, None)
        hf_dir = None if weights.tensors is not None else str(weights.hf_dir)
        report = self.engine.update_weights(hf_dir=hf_dir, state_dict=weights.tensors, version=weights.version,
                                            probe=probe)
        if report is not None:  # engines that check a push (SGLang) report it
            self.report = (stage, report)
            if self.pending is None:
                self._log_sync()

    def _push_per_node(self, weights: Weights, stage: int) -> None:
        """Each node's local rank 0 pushes the tensors it gathered to its own servers; then rank 0 checks that every
        server reports the new version (and the probe) and logs one sync for all. A failure on any node raises on
        every rank, naming the node's rank, so none waits for the others."""
        from megamu.engines.sglang.schema import SGLangError
        from megamu.engines.sglang.weight_sync import SyncReport

        if parallel.is_main_rank():
            self._resume(memory.WEIGHTS)  # every node's servers take their weight memory back first
        parallel.wait_for_main_rank()
        error, sent, seconds = "", 0, 0.0
        if self.node is not None:
            try:
                r = self.node.update_weights(state_dict=weights.tensors, version=weights.version)
                sent, seconds = r.bytes, r.seconds
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = f"rank {parallel.rank()}: {type(e).__name__}: {e}"
        pushed = parallel.all_gather_object((error, sent, seconds), wait=True)
        errors = [e for e, _, _ in pushed if e]
        if errors:
            raise SGLangError("the in-memory weight push failed on some nodes:\n" + "\n".join(errors))
        if not parallel.is_main_rank():
            return
        probe, self.pending = (None, weights.probe) if self.released else (weights.probe, None)
        confirmed = self.engine.adopt_weights(weights.version, probe)
        self.report = (stage, SyncReport("memory (tensor, per node)", max(s for _, _, s in pushed) + confirmed.seconds,
                                         confirmed.version, sum(b for _, b, _ in pushed),
                                         confirmed.probe_mean_abs_diff))
        if self.pending is None:
            self._log_sync()

    def wake(self) -> None:
        """The servers' KV cache and CUDA graphs back once the trainer has offloaded; then the push's probe (rank 0)."""
        if not parallel.is_main_rank():
            return
        self._resume(*memory.ALL)
        if self.pending is not None:
            from megamu.engines.sglang.weight_sync import check_probe

            stage, report = self.report
            self.report = (stage, replace(report, probe_mean_abs_diff=check_probe(self.engine, self.pending)))
            self.pending = None
            self._log_sync()

    def _log_sync(self) -> None:
        stage, r = self.report
        self.metrics.log("sync", step=stage, stage=stage, mode=r.mode, t_sync=r.seconds, bytes=r.bytes,
                         weight_version=r.version, probe_mean_abs_diff=r.probe_mean_abs_diff)

    def spread(self) -> bool:
        """SGLang servers that megamu launches, on several ranks: local rank 0 of every node starts its node's
        servers on that node's GPUs once the trainer has offloaded, and rank 0 dispatches over all of them. Staged
        mode starts them each stage; colocated mode once, keeping them between refreshes, when its pushes come from
        a folder (--weight-sync disk: every node's servers read it) or in memory (``pushes_per_node``)."""
        return self.launches_servers() and (parallel.world_size() > 1 or self.engine_cfg.sglang.router is not None)

    def launches_servers(self) -> bool:
        """SGLang servers megamu starts (not given by --sglang-url): megamu may restart them."""
        return self.engine_cfg.kind == "sglang" and not self.engine_cfg.sglang.urls

    def generate(self, stage: int, prompts: list[PromptRecord], version: int) -> None:
        """β_k generates D_k = {(x, y, A, b_1:T)} into the run directory, durable and resumable (rank 0). With
        ``spread``, every rank first takes part in starting the nodes' servers (collective, on the CPU group)."""
        if self.spread() and not self.warm:  # colocated: the servers of stage 0 stay up
            from megamu.engines.sglang.nodes import start_sglang

            self.engine, self.node = start_sglang(str(self.hf_dir), replace(self.engine_cfg.sglang,
                                                                            dtype=self.engine_cfg.dtype))
        elif self.spread() and self.node is not None:
            self.node.watching(True)  # colocated: a node's own probes run during rollouts only (release())
        if not self.warm and self.mode == "colocated" and self.launches_servers():
            self.launch_stage = stage  # restarts load its export: kept until close()
        if not parallel.is_main_rank():
            return
        if self.engine is None:
            self.engine = build_engine(self.engine_cfg, self.hf_dir)
        run_rollout_phase(self.engine, prompts, self.run_dir.stage_rollouts(stage), sampling=self.sampling(stage),
                          n_samples=self.cfg.n_samples, scorer=self._scorer(), tokenizer=self.tokenizer,
                          stage=stage, policy_version=version, groups_per_shard=self.cfg.groups_per_shard,
                          shards_per_call=self.cfg.shards_per_call, model_path=str(self.hf_dir or ""))

    def evaluate(self, stage: int, update: int, label: str, weights: Weights | None = None) -> None:
        """The evaluation sets scored with the engine's weights (the policy after ``update`` updates), or with
        ``weights`` (an HF folder) loaded first (rank 0)."""
        if not (parallel.is_main_rank() and self.eval_sets):
            return
        if weights is not None and self.engine is not None:
            self._resume(memory.WEIGHTS)
            self.engine.update_weights(hf_dir=str(weights.hf_dir), version=weights.version)
            self._resume(*memory.ALL)
        elif weights is not None:
            self.engine = build_engine(self.engine_cfg, weights.hf_dir)
        self.t_eval = evaluate_sets(self.engine, self.eval_sets, self.sampling(stage), self.evaluation, self._scorer(),
                                    self.tokenizer, self.metrics, stage=stage, update=update, label=label)

    def release(self) -> None:
        """After D_k: staged mode stops the engine, so its memory is free for the optimisation (§4, Phase 1);
        colocated mode keeps it for the next push, its servers' memory given back when they share the GPUs."""
        if self.spread():  # every node's servers serve until rank 0 is done with them (its phase and evaluation)
            parallel.wait_for_main_rank()
            if self.node is not None and self.mode == "colocated":
                self.node.watching(False)  # pushes come next: a server busy loading one may miss its probes
        if self.mode == "staged":  # each node's shutdown returns once its servers' processes are gone
            self._shutdown_engines()
        if self.saves_memory and self.engine is not None and not self.released:
            memory.release(self.engine, memory.ALL)
            self.released = memory.ALL
        self.warm = self.mode == "colocated"

    def _shutdown_engines(self) -> None:
        """Stop rank 0's engine and this node's servers (one engine when they are the same)."""
        for engine in {id(e): e for e in (self.engine, self.node) if e is not None}.values():
            engine.shutdown()
        self.engine = self.node = None

    def prune_export(self, stage: int) -> None:
        """Delete hf/stage_k once D_k is durable (rank 0). Not the folder running servers were launched from
        (colocated): a server restarted during a later stage loads it (then the last push); it goes at close()."""
        if parallel.is_main_rank() and stage != self.launch_stage:
            self.run_dir.prune_stage_export(stage)

    def _resume(self, *tags: str) -> None:
        todo = tuple(t for t in self.released if t in tags)
        if todo:
            memory.resume(self.engine, todo)
            self.released = tuple(t for t in self.released if t not in todo)

    def close(self) -> None:
        if self.spread() and self.mode == "colocated":  # every node's servers serve rank 0's final evaluation
            parallel.wait_for_main_rank()
        self._shutdown_engines()
        if self.launch_stage is not None and parallel.is_main_rank():
            self.run_dir.prune_stage_export(self.launch_stage)
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None

    def _scorer(self):
        if self.scorer is None:
            from megamu.reward import make_scorer

            self.scorer = make_scorer(self.cfg.reward)
        return self.scorer


def train_staged(run) -> None:
    """Stages of generate-then-optimise (§4): the engine and the trainer take turns, every step visible here."""
    cfg, plan, policy, run_dir = run.cfg, run.plan, run.policy, run.run_dir
    engine = StageEngine(plan.rollout_mode, cfg.engine, cfg.rollout, run_dir, run.tokenizer, run.metrics,
                         run.prompts.held_out, run.prompts.eval_sets, cfg.evaluation)
    for stage in range(run.state.stage, plan.num_stages):
        done = run_dir.stage_done(stage)
        parallel.barrier()  # every rank has looked before rank 0 can write D_k: all take the same branch
        t0 = t1 = time.perf_counter()
        if not done:
            publish(policy, engine, stage, run_dir.stage_export(stage))  # 1-2. θ_k -> β_k, the trainer offloaded
            t1 = time.perf_counter()
            engine.generate(stage, run.prompts.for_stage(stage), policy.version)  # 3. rank 0 writes D_k
            if stage == 0 or cfg.evaluation.due(run.state.update):  # on the engine that holds θ_k (--eval-interval)
                engine.evaluate(stage, run.state.update, "base" if stage == 0 else f"update {run.state.update}")
            engine.release()  # 4. staged: the engine exits; colocated: its servers release their memory
            parallel.wait_for_main_rank()  # ranks 1..N wait out the rollout on the CPU, not in an NCCL collective
            policy.onload()  # 5. the trainer's state comes back, bit for bit
            engine.prune_export(stage)  # 6. D_k is durable: hf/stage_k is no longer needed (unless servers launched
            # from it: their restarts load it)
            parallel.barrier()
        t2 = time.perf_counter()
        dataset = StageDataset(run_dir.stage_rollouts(stage))
        optimise(run, stage, dataset, engine.t_eval)  # 7. μ updates on the static D_k
        run.log_stage(stage, dataset, t_export=t1 - t0, t_rollout=t2 - t1, t_train=time.perf_counter() - t2)
    final_evaluation(run, engine)
    engine.close()


def final_evaluation(run, engine: StageEngine) -> None:
    """The final policy exported (collective, while every rank holds its weights), then held-out: the servers that
    evaluate it take their weights and KV cache back, or start, only once the trainer has given the device back."""
    final = run.export_final()
    run.policy.offload()
    engine.evaluate(run.plan.num_stages, run.state.update, "final", final)
    run.policy.onload()  # the spilled optimiser state comes back (and its spill files go) before the run's end


def publish(policy, engine: StageEngine, stage: int, export_dir: Path) -> None:
    """θ_k -> β_k (collective), then the device is the engine's: the weights are gathered (or exported) while the
    trainer holds them, the trainer's memory goes back before the servers' weights come back for the push, and the
    pushed tensors' blocks go back to the driver before the servers' KV cache does. slime orders its colocated
    refresh the same way (train.py: offload_train, then onload_weights, update_weights, onload_kv)."""
    want = engine.wants()
    weights = policy.weights(hf_dir=export_dir if want.folder else None, tensors=want.tensors,
                             every_node=want.every_node, probe_ids=want.probe_ids)
    policy.offload()  # the trainer gives the device back (§4)
    engine.load(weights, stage)  # colocated: the servers' weights come back for the push
    del weights  # the pushed tensors, before the rollout needs their memory
    policy.offload()  # again: now it only empties the allocator's cache of the pushed tensors' blocks
    engine.wake()  # colocated: the servers' KV cache comes back


def optimise(run, stage: int, dataset: StageDataset, t_eval: float) -> None:
    """μ updates on the static dataset D_k, resuming at the checkpoint's update; an ETA line after the first."""
    cfg, plan, state = run.cfg, run.plan, run.state
    start = state.update - stage * plan.mu
    batches = dataset.minibatches(plan.prompts_per_update, seed=cfg.seed + stage, start_update=start,
                                  num_updates=plan.mu)
    anchors = run.policy.behaviour_anchors(dataset.samples(), dataset.dir / "recomputed_logprobs.pt") \
        if cfg.recompute_behaviour_logprobs else None
    bar = run.progress_bar(f"optimise stage {stage}", total=plan.mu, initial=start)
    for samples in batches:
        if anchors is not None:
            samples = [replace(s, behaviour_logprobs=anchors[(s.prompt_id, s.sample_index)]) for s in samples]
        t0 = time.perf_counter()
        in_stage = state.update + 1 - stage * plan.mu  # after this update
        log = in_stage % cfg.log_interval == 0 or in_stage == plan.mu  # every --log-interval and the stage's last
        run.train_on(samples, stage, bar, log=log, save=checkpoint_due(run, in_stage))
        if not run.eta_shown:
            run.show_eta(stage, time.perf_counter() - t0, dataset.manifest.t_rollout_s, t_eval)
    bar.close()
    state.stage = stage + 1


def checkpoint_due(run, in_stage: int) -> bool:
    """Staged mode: every --save-interval updates of a stage and at each stage's end (a resume then skips the stage).
    Colocated mode refreshes every μ (= 4) updates: every --save-interval updates of the run and at its end, not at
    each refresh (1024 checkpoints in the paper's GRPO baseline)."""
    plan, interval, update = run.plan, run.cfg.save_interval, run.state.update + 1
    if plan.rollout_mode == "colocated":
        return update == plan.total_updates or bool(interval and update % interval == 0)
    return in_stage == plan.mu or bool(interval and in_stage % interval == 0)
