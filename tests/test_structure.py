"""The code's shape, checked: who may import whom, no import cycle, and configs that refuse bad values on their own
(every part can be built without megamu.arguments, by bench and tools code, and still be checked)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from megamu.errors import ConfigError

PACKAGE = Path(__file__).resolve().parents[1] / "megamu"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, top_level_only: bool) -> set[str]:
    """megamu modules ``path`` imports; with ``top_level_only``, only at import time (not inside functions, not
    under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # "from megamu.x import y" may be a module y
    return {m for m in found if m.split(".")[0] == "megamu"}


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_engines_and_rollout_never_import_the_trainer():
    """The loop hands engines and the rollout phase weights and prompts; they never reach for the policy."""
    trainer = ("megamu.training", "megamu.loop", "megamu.arguments", "megamu.config.run_config")
    bad = {name: sorted(m for m in module_imports(path, top_level_only=False) if m.startswith(trainer))
           for name, path in MODULES.items() if name.startswith(("megamu.engines", "megamu.rollout"))}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_config_tree_needs_nothing_of_the_loop():
    """The loop imports its configs (megamu.config.loop_config), never the other way round."""
    config = ("megamu.config.run_config", "megamu.config.loop_config", "megamu.arguments")
    bad = {name: sorted(m for m in module_imports(path, top_level_only=False) if m.split(".")[:2] == ["megamu", "loop"])
           for name, path in MODULES.items() if name.startswith(config)}
    assert {k: v for k, v in bad.items() if v} == {}


def test_engines_never_import_the_rollout_phase():
    """The loop hands the rollout phase the lifecycle's engine: engines import nothing of megamu.rollout (which
    imports engines), so the two never tie into a cycle."""
    bad = {name: sorted(m for m in module_imports(path, top_level_only=False) if m.startswith("megamu.rollout"))
           for name, path in MODULES.items() if name.startswith("megamu.engines")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_loop_never_reaches_into_sglang():
    """How SGLang servers live across stages is megamu.engines.lifecycle's business: the loop sees the protocol."""
    bad = {name: sorted(m for m in module_imports(path, top_level_only=False) if m.startswith("megamu.engines.sglang"))
           for name, path in MODULES.items() if name.startswith("megamu.loop")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_algo_is_pure_torch():
    """megamu.algo imports torch and itself; megamu.errors for its ConfigError and megamu.config_fields for its fields'
    flag declarations (the standard library's dataclasses only: no parser, no I/O)."""
    outside = {name: sorted(m for m in module_imports(path, top_level_only=False)
                            if not m.startswith(("megamu.algo", "megamu.errors", "megamu.config_fields")))
               for name, path in MODULES.items() if name.startswith("megamu.algo")}
    assert {k: v for k, v in outside.items() if v} == {}


def test_no_import_cycle():
    """Lazy imports count too: a cycle through a function-level import still ties the two modules together."""
    graph = {name: {m for m in module_imports(path, top_level_only=False) if m in MODULES and m != name}
             for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def folder_of(module: str) -> str:
    """The room a module lives in: its subpackage of megamu (``megamu.training.policy`` -> ``megamu.training``), or
    the module itself when it lies loose at megamu's top level."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else module


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name, [name])):
            return found
    return None


def folder_graph() -> dict[str, set[str]]:
    """Arrows between megamu's subpackages (and loose modules), lazy imports counted: an arrow a -> b when some
    module of a imports one of b."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if name == "megamu":
            continue
        src = folder_of(name)
        graph.setdefault(src, set()).update(
            folder_of(m) for m in module_imports(path, top_level_only=False) if m in MODULES and m != "megamu")
        graph[src].discard(src)
    return graph


def test_no_folder_level_cycle():
    """The rooms form layers: no package imports one that imports it back, through any chain and at any depth
    (today's main had convert <-> training and data <-> reward, each through one module)."""
    cycle = find_cycle(folder_graph())
    assert cycle is None, "folder cycle: " + " -> ".join(cycle)


def test_the_folder_scan_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert folder_of("megamu.training.policy") == folder_of("megamu.training") == "megamu.training"
    assert folder_of("megamu.mode") == "megamu.mode"


def stated_floors() -> list[set[str]]:
    """The floors megamu/__init__.py's docstring states, bottom to top: one line each, the rooms before the two or
    more spaces that start the line's description."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    floors = []
    for line in doc.split("Bottom to top:\n", 1)[1].splitlines():
        if match := re.match(r"^    (\w+(?:, \w+)*)\s{2,}\S", line):
            floors.append({f"megamu.{room}" for room in match.group(1).split(", ")})
    return floors


def arrows_not_down(graph: dict[str, set[str]], floors: list[set[str]]) -> list[str]:
    """Arrows a -> b where b's floor is not below a's (an unstated room counts as on no floor: every arrow to or
    from it is listed)."""
    floor_of = {room: i for i, rooms in enumerate(floors) for room in rooms}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if floor_of.get(b, len(floors)) >= floor_of.get(a, -1))


def test_every_import_goes_down_the_stated_floors():
    """megamu/__init__.py states the floor order; every room is on exactly one floor and imports only rooms below
    it (so the order stated is the real one: today's config imports training, engines, rollout, data and reward)."""
    floors, graph = stated_floors(), folder_graph()
    stated = [room for rooms in floors for room in rooms]
    assert sorted(stated) == sorted(graph)  # each room once, none missing, none that is not a room
    assert arrows_not_down(graph, floors) == []


def test_the_floor_check_sees_an_arrow_up_or_sideways_and_an_unstated_room():
    floors = [{"a"}, {"b", "c"}, {"d"}]
    assert arrows_not_down({"d": {"a", "b"}, "b": {"a"}, "c": set(), "a": set()}, floors) == []
    assert arrows_not_down({"a": {"b"}, "b": {"c"}, "d": {"e"}}, floors) == ["a -> b", "b -> c", "d -> e"]
    assert len(stated_floors()) > 1 and {"megamu.errors", "megamu.config_fields"} == stated_floors()[0]


LOOSE_MODULES_MAX = 3


def test_megamu_holds_packages_and_at_most_three_loose_modules():
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= LOOSE_MODULES_MAX, loose
    packages = [d for d in PACKAGE.iterdir() if d.is_dir() and d.name != "__pycache__"]
    assert all((d / "__init__.py").exists() for d in packages)


def _bad_configs():
    from megamu.config.loop_config import AsyncConfig
    from megamu.config.plan import AsyncPlan, StagedPlan
    from megamu.data.stage_prompts import PromptsConfig
    from megamu.engines import EngineConfig, SGLangConfig
    from megamu.reward.config import RewardConfig
    from megamu.rollout import RolloutConfig
    from megamu.runtime.device import CPU
    from megamu.training.optimizer import OptimizerConfig
    from megamu.training.policy import CheckpointConfig, PolicyConfig

    opt = OptimizerConfig()
    policy = dict(hf_checkpoint=None, device=CPU, optimizer=opt, checkpoint=CheckpointConfig(save=Path("r")),
                  offload_dir=Path("r/offload"))
    prompts = dict(files=("a.jsonl",), prompts_per_stage=4, held_out=0, seed=0, data_dir=Path("d"))
    plan = dict(prompts_per_update=2, n_samples_per_prompt=4, max_response_len=8, algorithm="grpo",
                rollout_mode="staged", num_stages=2, mu=4)
    async_plan = dict(prompts_per_update=2, n_samples_per_prompt=4, max_response_len=8, algorithm="grpo",
                      train_iters=8, weight_sync_interval=4, max_policy_lag=8)
    return [
        (OptimizerConfig, {"lr": 0.0}, "lr"), (OptimizerConfig, {"adam_beta2": 1.0}, "adam_beta2"),
        (PolicyConfig, {**policy, "micro_batch_size": 0}, "micro_batch_size"),
        (PolicyConfig, {**policy, "export_dtype": "int8"}, "export_dtype"),
        (CheckpointConfig, {"save": Path("r"), "keep_hf_exports": -1}, "keep_hf_exports"),
        (PromptsConfig, {**prompts, "prompts_per_stage": -1}, "prompts_per_stage"),
        (RolloutConfig, {"n_samples": 1}, "n_samples"), (RolloutConfig, {"top_p": 0.0}, "top_p"),
        (EngineConfig, {"kind": "vllm"}, "kind"), (EngineConfig, {"max_batch_size": 0}, "max_batch_size"),
        (SGLangConfig, {"weight_sync": "nfs"}, "weight_sync"), (SGLangConfig, {"tp_size": 0}, "tp_size"),
        (AsyncConfig, {"queue_groups": 0}, "queue_groups"),
        (RewardConfig, {"timeout_s": 0.0}, "timeout_s"),
        (StagedPlan, {**plan, "rollout_mode": "async"}, "rollout_mode"),  # async runs have an AsyncPlan
        (StagedPlan, {**plan, "mu": 0}, "mu"),
        (AsyncPlan, {**async_plan, "max_policy_lag": 2}, "max_policy_lag"),
        (AsyncPlan, {**async_plan, "train_iters": 0}, "train_iters"),
    ]


@pytest.mark.parametrize("make, kwargs, field", _bad_configs(), ids=lambda x: getattr(x, "__name__", None))
def test_each_config_refuses_a_bad_value_naming_the_field(make, kwargs, field):
    with pytest.raises(ConfigError) as e:
        make(**kwargs)
    assert e.value.field == field


MODE_NAMES = {"staged", "colocated", "async"}
# Files allowed to compare a mode name, by count, as a ceiling: none (megamu.arguments asks plan_type too).
MODE_TESTS_LEFT: dict[str, int] = {}


def _mode_comparisons(path: Path) -> int:
    """Comparisons that decide a mode by name: a mode name (or a tuple of them) on either side, or anything called
    ``rollout_mode`` compared with anything."""
    def named(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in MODE_NAMES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return (isinstance(node, ast.Attribute) and node.attr == "rollout_mode") or (
            isinstance(node, ast.Name) and node.id == "rollout_mode")

    return sum(any(named(n) for n in (c.left, *c.comparators))
               for c in ast.walk(ast.parse(path.read_text())) if isinstance(c, ast.Compare))


def test_no_mode_name_is_compared_outside_the_mode_object():
    """The mode is decided once, by megamu.mode (mode_of, asked by the plan); everyone else asks the Mode the plan
    holds."""
    root = PACKAGE.parent
    files = [*PACKAGE.rglob("*.py"), root / "pretrain_mu_grpo.py", *(root / "tools").rglob("*.py"),
             *(root / "bench").rglob("*.py")]
    found = {str(p.relative_to(root)): n for p in files if p.name != "mode.py" or p.parent != PACKAGE
             for n in [_mode_comparisons(p)] if n}
    assert {f: n for f, n in found.items() if n > MODE_TESTS_LEFT.get(f, 0)} == {}


def test_the_scan_sees_a_mode_comparison(tmp_path):
    """The scan above, on code that decides the mode by name the ways today's main did."""
    code = tmp_path / "m.py"
    code.write_text('a = plan.rollout_mode != "async"\nb = mode == "colocated"\nc = x in ("staged", "colocated")\n'
                    'd = rollout_mode in MODES\ne = kind == "sglang"\n')
    assert _mode_comparisons(code) == 4


def test_the_staged_loop_calls_the_lifecycle_and_reads_none_of_its_fields():
    """Every ``engine.x`` in megamu.loop.staged is a call: how the engine lives is the lifecycle's business."""
    tree = ast.parse((PACKAGE / "loop" / "staged.py").read_text())
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    reads = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.value.id == "engine" and id(n) not in called]
    assert reads == []


TESTS = PACKAGE.parent / "tests"


def cross_cutting() -> set[str]:
    """The cross-cutting entries of tests/ as tests/conftest.py's docstring lists them ("    e2e/   whole runs")."""
    doc = ast.get_docstring(ast.parse((TESTS / "conftest.py").read_text()))
    return {m.group(1) for m in re.finditer(r"^ {4}(\S+)\s{2,}\S", doc, re.MULTILINE)}


def test_tests_mirror_the_packages():
    """Each megamu package has its test folder (a package, with tests in it); every other folder or test file at
    the top of tests/ is one conftest.py names cross-cutting, and each one it names is there."""
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    listed = cross_cutting()
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    top_tests = {p.name for p in TESTS.glob("test_*.py")}
    untested = {name for name in packages
                if not (TESTS / name / "__init__.py").is_file() or not any((TESTS / name).glob("test_*.py"))}
    assert untested == set()
    assert folders - packages - {f.rstrip("/") for f in listed if f.endswith("/")} == set()
    assert top_tests - listed == set()
    assert {f for f in listed if not (TESTS / f.rstrip("/")).exists()} == set()
    assert {f.rstrip("/") for f in listed} & packages == set()  # a package's folder is never cross-cutting


def test_the_cross_cutting_list_is_read():
    """The list above is what conftest.py's docstring says, not an empty parse that would let anything pass."""
    assert {"e2e/", "lab/", "gpu/", "sglang_real/", "tools/", "test_structure.py"} <= cross_cutting()
