"""Run bookkeeping: the run directory (``--save``), every path a run writes and what may be pruned when
(``run_dir``)."""
