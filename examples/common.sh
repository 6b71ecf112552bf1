# Shared by every example run script: the paper's App. B settings on 4xH200 (source it through a model.sh).
#
# Environment (all optional):
#   GPUS=4            GPUs per node            NNODES=1, NODE_RANK=0, MASTER_ADDR, MASTER_PORT=29500 (multi-node)
#   MODEL_ROOT=/models  where HF model folders live (HF_CHECKPOINT overrides the whole path)
#   DATA_DIR=/data      PROMPT_DATA overrides the training file (default $DATA_DIR/deepscaler.jsonl)
#   RUN_ROOT=runs       SAVE_DIR overrides the run directory (default $RUN_ROOT/<model>/<algorithm>)
#   SGLANG_URL          URL[,URL] of running SGLang servers or an sglang-router (default: start one server per GPU)
#   DRY_RUN=1           validate the flags and print the plan only (python, no torchrun, no GPU, no weights needed)
#   HOST_MEMORY_GIB     RAM of one node for the host-memory plan (default: the job's cgroup memory limit, else the
#                       RAM of the GPU machine that runs this; a dry run without GPUs plans the host only when set)
#   PYTHON, TORCHRUN    interpreters to launch with (default python, torchrun)
# Extra arguments to a run script are appended to the flags and win over them (argparse: last one counts).

set -euo pipefail

MEGAMU_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPUS=${GPUS:-4}
NNODES=${NNODES:-1}
MAX_PROMPT_LEN=1024
# The offload/reload cycles around each rollout fragment the caching allocator; expandable segments let freed blocks
# be reused for the next phase's differently sized tensors (PyTorch's documented remedy for fragmentation OOMs).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# Settings common to every method (App. B): AdamW, lr 1e-6 constant, betas (0.9, 0.999), wd 0.01, no KL term
# (the trainer has none), binary math-verify reward, T = 1.0, G = 8 samples, B_mini = 32 prompt groups per update.
paper_flags() {
    local data="${PROMPT_DATA:-${DATA_DIR:-/data}/deepscaler.jsonl}"
    PAPER_FLAGS=(
        --hf-checkpoint "${HF_CHECKPOINT:-${MODEL_ROOT:-/models}/$HF_NAME}"
        --prompt-data "$data"
        --max-prompt-length "$MAX_PROMPT_LEN"
        --rollout-max-response-len "$((CONTEXT_LEN - MAX_PROMPT_LEN))"
        --n-samples-per-prompt 8
        --prompts-per-update 32
        --lr 1e-6 --lr-warmup-iters 0 --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.999 --clip-grad 1.0
        --rollout-temperature 1.0 --rollout-top-p 1.0
        --bf16 --transformer-impl transformer_engine
        --tensor-model-parallel-size "$TP"
        --micro-batch-size "$MICRO_BATCH_SIZE"
        --rollout-engine sglang
        --behaviour-logprobs engine
        --rollout-groups-per-shard 256 --rollout-shards-per-call 4
        --save-interval 200 --hf-export-interval 200 --log-interval 1 --seed 1234
        # every collective of the training step may wait this long for a slow rank (checkpoint saves wait on their
        # own gloo group, sized to the save; the rollout's waits on another): megatron-LM's default is 10 minutes
        --distributed-timeout-minutes 30
        --eval-prompts 0
    )
    if [[ -n "${SGLANG_URL:-}" ]]; then
        PAPER_FLAGS+=(--sglang-url "$SGLANG_URL")
    else
        # One server per GPU (TP 1): every model here fits one H200, and DP over servers decodes fastest. Servers
        # started by the trainer live on rank 0's node; to roll out on every node use SGLANG_URL (docs/cluster.md).
        # SGLang 0.5.23 applies --mem-fraction-static to the memory free when the server starts, which already
        # excludes whatever the trainer still holds (nothing much: --offload-train, on in staged mode, moves its
        # weights, gradients and Adam state off the GPUs first), so no room needs leaving for the trainer; the
        # remaining 15% is for SGLang's own activations and CUDA graphs. Deterministic inference is left off: its
        # batch-invariant kernels are slower, and it only makes a resumed rollout redraw the same samples (each shard
        # records which mode made it); ROLLOUT_DETERMINISTIC=1 turns it on.
        PAPER_FLAGS+=(--sglang-num-servers "$GPUS" --sglang-tp-size 1
                      --sglang-server-args "--mem-fraction-static ${SGLANG_MEM_FRACTION:-0.85}")
        if [ "${ROLLOUT_DETERMINISTIC:-0}" = "1" ]; then
            PAPER_FLAGS+=(--rollout-deterministic)
        fi
    fi
}

# megamu_launch METHOD FLAGS... : run pretrain_mu_grpo.py with the model's and the method's flags.
megamu_launch() {
    local method=$1
    shift
    paper_flags
    local save="${SAVE_DIR:-${RUN_ROOT:-$MEGAMU_ROOT/runs}/$MODEL_NAME/$method}"
    local flags=("${PAPER_FLAGS[@]}" --save "$save")
    [[ -n "${HOST_MEMORY_GIB:-}" ]] && flags+=(--host-memory-gib "$HOST_MEMORY_GIB")
    flags+=("$@")
    cd "$MEGAMU_ROOT"
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        # WORLD_SIZE lets the dry run check TP against the GPUs the real launch would have; LOCAL_WORLD_SIZE (as
        # torchrun sets it) gives the host-memory plan the ranks of one node.
        WORLD_SIZE=$((GPUS * NNODES)) LOCAL_WORLD_SIZE=$GPUS exec "${PYTHON:-python}" pretrain_mu_grpo.py "${flags[@]}" --dry-run
    fi
    local dist=(--nproc_per_node "$GPUS")
    if ((NNODES > 1)); then
        dist+=(--nnodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK on every node}"
               --rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}"
               --rdzv_id "${RDZV_ID:-$MODEL_NAME-$method}")
    fi
    exec "${TORCHRUN:-torchrun}" "${dist[@]}" pretrain_mu_grpo.py "${flags[@]}"
}

# μ-GRPO (§4): 4 stages x μ = 1024 updates, relaxed clip [0, 5], sequence-scope negative-advantage veto at τ = 1e-4.
run_mu_grpo() {
    megamu_launch mu-grpo --algorithm mu-grpo --num-stages 4 --mu 1024 --rollout-mode staged \
        --clip-low 1.0 --clip-high 4.0 --nav-threshold 1e-4 --nav-scope sequence "$@"
}

# Standard GRPO, low staleness: μ = 4, ε = 0.2, 1024 refreshes; the engine stays up and weights are pushed in place.
# Its servers share the trainer's GPUs, so they release their KV cache and weights while the trainer trains
# (--sglang-memory-saver): resident through training, they would leave ~15 GiB of an H200 for it.
run_grpo() {
    megamu_launch grpo --algorithm grpo --num-stages 1024 --mu 4 --rollout-mode colocated --sglang-memory-saver \
        --clip-low 0.2 --clip-high 0.2 "$@"
}

# GRPO at μ = 1024 through the same staged pipeline as μ-GRPO, default clip, no veto (isolates the stabiliser).
run_grpo_high_staleness() {
    megamu_launch grpo-high-staleness --algorithm grpo-high-staleness --num-stages 4 --mu 1024 --rollout-mode staged \
        --clip-low 0.2 --clip-high 0.2 "$@"
}

# M2PO at μ = 1024 with the recommended second-moment threshold 0.04.
run_m2po() {
    megamu_launch m2po --algorithm m2po --num-stages 4 --mu 1024 --rollout-mode staged --m2po-threshold 0.04 "$@"
}

# Asynchronous execution (§5.1, Table 2, App. B): rollout and training at once, the 4 GPUs split 2 + 2. The trainer is
# torchrun on TRAIN_GPUS; the engine process's SGLang servers (one per GPU) run on ROLLOUT_GPUS. Weights are pushed
# every 4 updates; the queue and the maximum policy lag K differ per method (see below).
megamu_launch_async() {
    local method=$1
    shift
    local train_gpus=${TRAIN_GPUS:-0,1} rollout_gpus=${ROLLOUT_GPUS:-2,3}
    export CUDA_VISIBLE_DEVICES=$train_gpus
    GPUS=$(($(tr -cd ',' <<< "$train_gpus" | wc -c) + 1))
    local n_rollout=$(($(tr -cd ',' <<< "$rollout_gpus" | wc -c) + 1))
    SGLANG_MEM_FRACTION=${SGLANG_MEM_FRACTION:-0.85}  # the rollout GPUs hold no trainer state
    megamu_launch "$method" --rollout-mode async --train-iters 4096 --weight-sync-interval 4 \
        --rollout-devices "$rollout_gpus" --sglang-num-servers "$n_rollout" \
        --rollout-groups-per-shard 32 --rollout-shards-per-call 1 "$@"
}

# Async μ-GRPO: up to 255 sync intervals of extra staleness, a maximum lag of (1 + 255) x 4 = 1024 updates (the μ = 1024
# staleness of the staged setting); μ-GRPO's relaxed clip and veto.
run_mu_grpo_async() {
    megamu_launch_async mu-grpo-async --algorithm mu-grpo --max-policy-lag 1024 \
        --clip-low 1.0 --clip-high 4.0 --nav-threshold 1e-4 --nav-scope sequence "$@"
}

# Async GRPO: no extra staleness allowance, a maximum lag of one sync interval (4 updates); clip 0.2.
run_grpo_async() {
    megamu_launch_async grpo-async --algorithm grpo --max-policy-lag 4 --clip-low 0.2 --clip-high 0.2 "$@"
}
