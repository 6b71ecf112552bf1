"""The Dockerfile's pinned versions agree with setup.py's requirements (the gpu extra above all)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def dockerfile_pins() -> dict[str, str]:
    """{package: version} of every `"name[extras]==${ARG}"` in the Dockerfile, ARG defaults substituted."""
    text = (REPO / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, flags=re.M))
    pins = {}
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
    assert {"sglang", "sglang-router", "megatron-core", "transformer-engine", "torch"} <= set(pins)
    assert pins["sglang"] == "0.5.23"  # the weight-update API changes between releases
    checked = 0
    for group, group_reqs in reqs.items():
        for req in group_reqs:
            name = canonicalize_name(req.name)
            if name in pins:
                assert req.specifier.contains(pins[name], prereleases=True), (
                    f"Dockerfile {name}=={pins[name]} violates setup.py [{group}] {req}")
                checked += 1
    assert checked >= 5


def test_base_image_carries_the_pinned_torch():
    text = (REPO / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, flags=re.M).group(1)
    assert f":{dockerfile_pins()['torch']}-" in base, f"base image {base} is not built on the pinned torch"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, flags=re.M)


def test_transformer_engine_pin_is_in_the_range_megatron_core_is_tested_with():
    """megatron-core declares the transformer-engine it is tested with in its "dev" extra; read it from the installed
    distribution's metadata (CI installs the version the Dockerfile pins)."""
    from importlib.metadata import requires, version

    pins = dockerfile_pins()
    installed = version("megatron-core")
    if installed != pins["megatron-core"]:
        pytest.skip(f"megatron-core {installed} is installed, the Dockerfile pins {pins['megatron-core']}")
    te = [Requirement(r) for r in requires("megatron-core") if canonicalize_name(Requirement(r).name) ==
          "transformer-engine"]
    dev = [r for r in te if r.marker is not None and r.marker.evaluate({"extra": "dev", "sys_platform": "linux"})]
    assert dev, f"megatron-core {installed} declares no transformer-engine in its dev extra: {te}"
    for req in dev:
        assert req.specifier.contains(pins["transformer-engine"], prereleases=True), (
            f"Dockerfile transformer-engine=={pins['transformer-engine']} is outside megatron-core {installed}'s {req}")
