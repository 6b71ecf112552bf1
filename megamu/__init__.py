"""megamu: μ-GRPO training with Megatron-core actors and SGLang rollout servers (pretrain_mu_grpo.py is the entry).

Its rooms (the subpackages, and the loose modules errors, config_fields and mode) stand on floors: a room imports
only rooms on floors below its own, lazy and type-only imports included, so no two rooms import each other through
any chain. tests/test_structure.py reads the list below and checks every import in megamu against it. Bottom to top:

    errors, config_fields         ConfigError and its checks; config fields that carry their flag
    algo, reward, runtime         the paper's math (pure torch); rewards; devices, process groups, atomic files
    data, model, observability    prompts and their rows; GPTModel from HF configs; metrics and trackers
    convert                       HF <-> Megatron weights
    engines                       rollout engines (in-process, SGLang servers) and their lifecycle across stages
    rollout                       a stage's generation and its durable dataset; async mode's engine process
    run                           the run directory and its lock
    mode                          staged, colocated or async, and what each implies
    memory                        the memory plan before a run, and the trainer's memory measured
    training                      the policy: model, optimiser, checkpoints, offload
    config                        RunConfig (one config per part) and the plan
    arguments, evaluation         the flags read into a RunConfig; evaluation during and after a run
    loop                          the Trainer and its loops
"""
