"""The Dockerfile's pinned versions agree with setup.py's requirements (the gpu extra above all) and with the table
of docs/cluster.md that cites where slime pins the same combination (no network: the files are read)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def dockerfile_args() -> dict[str, str]:
    return {k: v.strip('"') for k, v in re.findall(r"^ARG\s+(\w+)=(\S+)", (REPO / "Dockerfile").read_text(),
                                                    flags=re.M)}


def dockerfile_pins() -> dict[str, str]:
    """{package: version} of every `"name[extras]==${ARG}"` in the Dockerfile, ARG defaults substituted, and the
    base image's torch and sglang (checked at build time against TORCH_VERSION and SGLANG_VERSION)."""
    text = (REPO / "Dockerfile").read_text()
    args = dockerfile_args()
    pins = {"torch": args["TORCH_VERSION"], "sglang": args["SGLANG_VERSION"]}
    assert "${TORCH_VERSION}" in text and "${SGLANG_VERSION}" in text  # the build asserts the base carries them
    for name, var in re.findall(r'"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==\$\{(\w+)\}"', text):
        assert var in args, f"Dockerfile pins {name} to ${{{var}}}, which has no ARG default"
        pins[canonicalize_name(name)] = args[var].strip('"')
    return pins


def setup_requirements() -> dict[str, list[Requirement]]:
    """CORE and EXTRAS of setup.py, read without running it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("CORE", "EXTRAS"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    groups = {"core": values["CORE"], **values["EXTRAS"]}
    return {g: [Requirement(r) for r in reqs] for g, reqs in groups.items()}


def test_gpu_extra_is_pinned_in_dockerfile_and_compatible():
    pins, reqs = dockerfile_pins(), setup_requirements()
    assert reqs["gpu"], "setup.py has no gpu extra"
    for req in reqs["gpu"]:
        name = canonicalize_name(req.name)
        assert name in pins, f"setup.py gpu extra needs {req}, the Dockerfile does not pin {name}"
        assert req.specifier.contains(pins[name], prereleases=True), f"Dockerfile {name}=={pins[name]} violates {req}"


def test_every_dockerfile_pin_satisfies_setup_py():
    pins, reqs = dockerfile_pins(), setup_requirements()
    assert {"sglang", "sglang-router", "transformer-engine", "torch"} <= set(pins)
    checked = 0
    for group, group_reqs in reqs.items():
        for req in group_reqs:
            name = canonicalize_name(req.name)
            if name in pins:
                assert req.specifier.contains(pins[name], prereleases=True), (
                    f"Dockerfile {name}=={pins[name]} violates setup.py [{group}] {req}")
                checked += 1
    assert checked >= 4


def test_the_pins_are_slimes_combination_as_docs_cluster_md_cites_it():
    """The Dockerfile, its comments and docs/cluster.md's table name the same versions and the same slime commit."""
    args, text = dockerfile_args(), (REPO / "Dockerfile").read_text()
    docs = (REPO / "docs" / "cluster.md").read_text()
    rows = dict(re.findall(r"^\| (base image|torch|sglang|transformer-engine|megatron-core) \| ([^|]+) \|", docs,
                           flags=re.M))
    assert rows["base image"].strip().strip("`") == args["BASE_IMAGE"]
    assert rows["torch"].strip() == args["TORCH_VERSION"]
    assert rows["sglang"].strip() == args["SGLANG_VERSION"]
    assert rows["transformer-engine"].strip() == args["TRANSFORMER_ENGINE_VERSION"]
    assert rows["megatron-core"].strip() == f"Megatron-LM @{args['MEGATRON_COMMIT']}"
    assert f":v{args['SGLANG_VERSION']}-" in args["BASE_IMAGE"]  # the base is the pinned SGLang's image
    slime = re.search(r"THUDM/slime @([0-9a-f]{40})", text).group(1)
    assert f"THUDM/slime @{slime}" in docs
    assert "git checkout ${MEGATRON_COMMIT}" in text and re.search(r"^FROM \$\{BASE_IMAGE\}", text, flags=re.M)
