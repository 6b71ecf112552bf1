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


# ---- issue 50 item 1: the image runs the megatron-core it pins ----

def dockerfile_steps() -> list[str]:
    """The Dockerfile's instructions in order, continuation lines joined and comments dropped."""
    lines = [ln for ln in (REPO / "Dockerfile").read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [re.sub(r"\s+", " ", s).strip() for s in joined.splitlines() if s.strip()]


def _index(steps: list[str], *needles: str) -> int:
    hits = [i for i, s in enumerate(steps) if all(n in s for n in needles)]
    assert len(hits) == 1, f"expected one Dockerfile step with {needles}, found {len(hits)}"
    return hits[0]


def test_megatron_checkout_survives_megamus_install():
    """pip keeps an installed distribution only while its version satisfies every requirement and constraint; the
    Megatron-LM checkout's version (0.16.0rc0) must therefore be admitted by setup.py and frozen as a constraint
    before megamu's install, and the build checks afterwards that megatron.core still is the checkout."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    args, steps = dockerfile_args(), dockerfile_steps()
    pinned = Version(args["MEGATRON_CORE_VERSION"])
    assert pinned.is_prerelease  # 1dcf0daf's package_info.py: 0.16.0rc0 (the case the old `>=0.16.1` missed)
    (req,) = [r for r in setup_requirements()["core"] if canonicalize_name(r.name) == "megatron-core"]
    # both as pip checks an installed distribution (prereleases allowed) and as a resolver that does not opt in
    assert req.specifier.contains(pinned, prereleases=True), f"setup.py {req} would make pip replace {pinned}"
    assert req.specifier.contains(pinned), f"setup.py {req} admits {pinned} only with --pre"
    assert not SpecifierSet(">=0.16.1").contains(pinned, prereleases=True)  # the spec before issue 50

    megatron = _index(steps, "git checkout ${MEGATRON_COMMIT}")
    assert "--no-deps -e ." in steps[megatron]
    freeze = _index(steps, 'echo "megatron-core==${MEGATRON_CORE_VERSION}" >> /opt/constraints.txt')
    megamu = _index(steps, 'pip install -c /opt/constraints.txt -e ".[gpu]"')
    assert megatron <= freeze < megamu, "the constraint must be written after the checkout and before megamu"
    check = ("check_megatron_pin.py --source /opt/Megatron-LM --commit ${MEGATRON_COMMIT} "
             "--version ${MEGATRON_CORE_VERSION}")
    assert check in steps[megamu] and steps[megamu].index(check) > steps[megamu].index('-e ".[gpu]"')
    assert check in steps[megatron]
    assert _index(steps, "COPY tools/check_megatron_pin.py") < megatron
    # nothing after the freeze overwrites the constraints (only `>` writes a new file) or installs without them
    for step in steps[freeze + 1:]:
        assert "> /opt/constraints.txt" not in step.replace(">> /opt/constraints.txt", "")
        if re.search(r"pip install (?!.*-c /opt/constraints.txt)", step):
            assert "apex" in step, f"a pip install after the megatron-core pin ignores the constraints: {step}"


def test_pip_keeps_an_installed_distribution_only_while_the_specifier_admits_it():
    """The pip fact the test above rests on, pinned to the venv's pip (26.3) source:
    pip/_internal/resolution/resolvelib/factory.py:294-297 drops the installed distribution (and installs another)
    unless ``specifier.contains(installed_version, prereleases=True)``: an installed prerelease counts, one below the
    bound does not."""
    import pip._internal.resolution.resolvelib.factory as factory

    lines = [ln.strip() for ln in Path(factory.__file__).read_text().splitlines()]
    # found by its text (the Makefile upgrades pip: the line moves between releases; 296 in pip 26.3)
    i = lines.index("if not specifier.contains(installed_dist.version, prereleases=True):")
    assert "does not fit the current dependency graph" in lines[i - 1] and lines[i + 1] == "return None"


def _fake_megatron(tmp_path: Path, version: str, dist_version: str) -> tuple[Path, str]:
    """A git checkout holding `megatron/core` at `version` and a dist-info saying `dist_version`; its commit."""
    import subprocess

    src = tmp_path / "Megatron-LM"
    (src / "megatron" / "core").mkdir(parents=True)
    (src / "megatron" / "__init__.py").write_text("")
    (src / "megatron" / "core" / "__init__.py").write_text("")
    (src / "megatron" / "core" / "package_info.py").write_text(f"__version__ = {version!r}\n")
    dist = tmp_path / "site" / f"megatron_core-{dist_version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {dist_version}\n")
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "pin"], check=True)
    head = subprocess.run(git[:3] + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    return src, head


def _run_check(tmp_path: Path, src: Path, commit: str, version: str):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{tmp_path / 'site'}"}
    return subprocess.run([sys.executable, str(REPO / "tools" / "check_megatron_pin.py"), "--source", str(src),
                           "--commit", commit, "--version", version], env=env, capture_output=True, text=True,
                          cwd=tmp_path)


def test_build_check_passes_only_on_the_pinned_checkout(tmp_path):
    src, head = _fake_megatron(tmp_path, "0.16.0rc0", "0.16.0rc0")
    ok = _run_check(tmp_path, src, head, "0.16.0rc0")
    assert ok.returncode == 0, ok.stderr
    assert f"megatron-core 0.16.0rc0 from {src.resolve()} @{head}" in ok.stdout
    wrong_commit = _run_check(tmp_path, src, "0" * 40, "0.16.0rc0")
    assert wrong_commit.returncode == 1 and f"is at {head}, the pin is {'0' * 40}" in wrong_commit.stderr
    wrong_version = _run_check(tmp_path, src, head, "0.16.1")
    assert wrong_version.returncode == 1 and "__version__ is 0.16.0rc0, the pin is 0.16.1" in wrong_version.stderr


def test_build_check_fails_when_pip_replaced_the_checkout(tmp_path):
    """pip's replacement: a release's dist-info, and megatron.core imported from site-packages, not the checkout."""
    src, head = _fake_megatron(tmp_path, "0.16.0rc0", "0.19.2")
    replaced = _run_check(tmp_path, src, head, "0.16.0rc0")
    assert replaced.returncode == 1
    assert "pip's megatron-core is 0.19.2, the pin is 0.16.0rc0" in replaced.stderr
    elsewhere = _run_check(tmp_path, tmp_path / "site", head, "0.16.0rc0")  # the package is not under --source
    assert elsewhere.returncode == 1 and f"not from the checkout {(tmp_path / 'site').resolve()}" in elsewhere.stderr
