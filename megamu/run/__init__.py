"""The run directory (``--save``): every path a run writes and what may be pruned when (``run_dir``), and the lock
that keeps one launch per directory (``run_lock``).

A room of its own rather than part of megamu.runtime: runtime is a bottom floor (devices, process groups, atomic
files; it imports only megamu.errors), while the run directory knows the rollout's layout (a stage's dataset is
durable once its manifest exists, megamu.rollout.dataset.MANIFEST), so it stands above megamu.rollout."""
