"""The run's config tree: ``RunConfig`` and its derivations (``run_config``), the loop's parts (``loop_config``) and
the run's shape, staged or async (``plan``). Built from the flags by megamu.arguments or in code alike; the parts'
own configs live beside the parts (megamu.engines, megamu.rollout, megamu.training, ...)."""
