"""The run's loops: staged.py (μ-GRPO's stages, and colocated standard GRPO) and async_.py (§5.1), on the parts
run.py builds. Each loop owns its cadence: when weights reach the engine, when checkpoints are written."""
