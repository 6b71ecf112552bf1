"""Memory planning: the model's shape as the planner sees it (``model_shape``), the per-phase footprints
(``memory_plan_phases``), the plan that fits a run on its devices (``memory_plan``) and the fixes it suggests when
it does not (``memory_fixes``)."""
