"""Packaging: pyproject.toml declares the supported dependency ranges; constraints.txt
(the oldest supported stack) and constraints-newest.txt (the newest JAX) pin the exact
versions the two CI legs test; the built wheel installs and imports on its own, next to
the dependencies already there (jax 0.12.0.1 included), without an index."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOWER, UPPER = {">=", ">", "~="}, {"<", "<=", "~="}


def _requirements(key):
    project = PYPROJECT["project"]
    reqs = project["dependencies"] if key == "runtime" else project["optional-dependencies"][key]
    return [Requirement(r) for r in reqs]


CONSTRAINTS = {"constraints.txt": ".venv", "constraints-newest.txt": ".venv-newest"}


def _pins(name="constraints.txt"):
    """A constraints file as {canonical name: Version}; every line must be an exact pin."""
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==" and not req.marker and not req.extras, line
        pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


@pytest.mark.parametrize("key", ["runtime", "dev"])
def test_dependencies_are_ranges(key):
    for req in _requirements(key):
        ops = {s.operator for s in req.specifier}
        assert not ops & {"==", "==="}, f"{req}: a library declares ranges, not pins"
        assert ops & LOWER, f"{req}: no lower bound"
        # setuptools (dev only: it builds the wheel in test_wheel_*) needs no ceiling.
        if key == "runtime" or req.name != "setuptools":
            assert ops & UPPER, f"{req}: no upper bound"


@pytest.mark.parametrize("constraints", sorted(CONSTRAINTS))
def test_constraints_pin_every_dependency_inside_its_range(constraints):
    pins = _pins(constraints)
    assert "zerojax" not in pins
    build = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    for req in _requirements("runtime") + _requirements("dev") + build:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in {constraints}"
        assert req.specifier.contains(pins[name]), f"{req.name}=={pins[name]} outside {req}"


def test_the_legs_span_the_supported_jax_range():
    """The oldest leg tests the floor of the jax range; the newest the last series below
    its ceiling."""
    (jax,) = [r for r in _requirements("runtime") if r.name == "jax"]
    (floor,) = [Version(s.version) for s in jax.specifier if s.operator == ">="]
    (ceiling,) = [Version(s.version) for s in jax.specifier if s.operator == "<"]
    oldest, newest = _pins()["jax"], _pins("constraints-newest.txt")["jax"]
    assert oldest == floor
    assert (newest.major, newest.minor + 1) == (ceiling.major, ceiling.minor)


def _this_constraints():
    """The constraints file whose jax pin is the installed jax (None: neither)."""
    jax = Version(importlib.metadata.version("jax"))
    return next((ROOT / c for c in sorted(CONSTRAINTS) if _pins(c)["jax"] == jax), None)


def test_license_is_an_spdx_expression():
    # The table form ({text = ...}) is deprecated; the string form needs setuptools>=77.
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    (backend,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    assert backend.name == "setuptools"
    assert not backend.specifier.contains("76.1") and backend.specifier.contains("77.0")


_VENVS = {(ROOT / venv).resolve(): c for c, venv in CONSTRAINTS.items()}


@pytest.mark.skipif(
    Path(sys.prefix).resolve() not in _VENVS,
    reason="checks the project's own .venv or .venv-newest (made by scripts/setup.sh); "
    "this is another environment",
)
def test_project_venv_matches_constraints():
    constraints = _VENVS[Path(sys.prefix).resolve()]
    for name, version in _pins(constraints).items():
        assert Version(importlib.metadata.version(name)) == version, (constraints, name)


# --- the built wheel, installed into fresh environments --------------------------------

# Subprocesses see neither pip's user/site configuration nor the caller's PYTHONPATH.
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
ENV.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")


def _run(*args, cwd, env=ENV, check=True):
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check and out.returncode:
        pytest.fail(f"{args} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """zerojax's wheel, built from a copy of the sources (the tree stays clean) with
    this environment's setuptools, so no index is needed."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    shutil.copytree(ROOT / "zerojax", src / "zerojax", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
         "--check-build-dependencies", "--quiet", "-w", dist, cwd=src)
    (path,) = dist.glob("zerojax-*.whl")
    return path


@pytest.fixture(scope="module")
def outer_site(tmp_path_factory):
    return _outer_site(tmp_path_factory.mktemp("outer") / "site-packages")


def _outer_site(path):
    """This environment's packages as one directory of links, less zerojax itself (its
    editable install would count as installed) and less its .pth files."""
    path.mkdir()
    for site in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")):
        for entry in Path(site).iterdir():
            name = entry.name.lower()
            if not (name.startswith(("zerojax", "__editable__")) or name.endswith(".pth")):
                (path / entry.name).symlink_to(entry)
    return path


def _fresh_venv(path, outer_site):
    """A new venv (no pip of its own) that also sees this environment's packages, as
    --system-site-packages would if this environment were the system one: jax & co are
    there without downloading, and this environment's pip runs inside the new venv (a
    plain path line in a .pth puts them after the venv's own site-packages)."""
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / "bin" / "python"
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                cwd=path).stdout.strip()
    (Path(site) / "outer-env.pth").write_text(f"{outer_site}\n")
    return python, Path(site)


def _fake_installed(path, **versions):
    """Metadata-only distributions: to pip, these versions are installed."""
    for name, version in versions.items():
        info = path / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("pip\n")
    return {**ENV, "PYTHONPATH": str(path)}


def _dry_run(python, wheel, cwd, env):
    return _run(python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-",
                "--no-index", "--find-links", wheel.parent, "zerojax", cwd=cwd, env=env,
                check=False)


@pytest.mark.slow
def test_wheel_metadata(wheel):
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(f"{wheel.name.split('-py')[0]}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta
    requires = {line.split(": ", 1)[1] for line in meta.splitlines()
                if line.startswith("Requires-Dist: ") and "extra ==" not in line}
    assert {Requirement(r).name: Requirement(r).specifier for r in requires} == {
        r.name: r.specifier for r in _requirements("runtime")}


@pytest.mark.slow
def test_wheel_installs_without_index_and_imports_from_its_venv(wheel, outer_site, tmp_path):
    python, site = _fresh_venv(tmp_path / "venv", outer_site)
    # With dependencies but no index: everything it needs is already installed.
    constraints = _this_constraints()
    _run(python, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", wheel.parent,
         *(["-c", constraints] if constraints else []), "zerojax", cwd=tmp_path)
    out = _run(python, "-c", "import json, jax, zerojax; print(json.dumps("
               "[zerojax.__version__, zerojax.__file__, jax.__version__]))", cwd=tmp_path)
    version, file, jax_version = json.loads(out.stdout)
    assert version == PYPROJECT["project"]["version"]
    assert Path(file).resolve().is_relative_to(site.resolve()), file
    assert not Path(file).resolve().is_relative_to(ROOT), file
    assert jax_version == importlib.metadata.version("jax")


@pytest.mark.slow
def test_install_keeps_a_newer_compatible_jax(wheel, outer_site, tmp_path):
    python, _ = _fresh_venv(tmp_path / "venv", outer_site)
    (jax,) = [r for r in _requirements("runtime") if r.name == "jax"]
    (ceiling,) = [Version(s.version) for s in jax.specifier if s.operator == "<"]
    newer = f"{ceiling.major}.{ceiling.minor - 1}.99"  # the last minor we support, patched
    assert jax.specifier.contains(newer)
    assert Version(newer) > Version(importlib.metadata.version("jax"))
    # The JAX this environment has is kept ...
    out = _dry_run(python, wheel, tmp_path, ENV)
    assert out.returncode == 0, out.stderr
    assert [i["metadata"]["name"] for i in json.loads(out.stdout)["install"]] == ["zerojax"]
    # ... and so is a newer one inside the range: nothing to install but zerojax (exact
    # pins, as before, made pip demand jax==0.10.2 here).
    env = _fake_installed(tmp_path / "newer", jax=newer, jaxlib=newer)
    out = _dry_run(python, wheel, tmp_path, env)
    assert out.returncode == 0, out.stderr
    assert [i["metadata"]["name"] for i in json.loads(out.stdout)["install"]] == ["zerojax"]
    # jax 0.12.1, the newest release (real in the newest leg, its metadata here):
    # kept, not downgraded to the oldest supported.
    env = _fake_installed(tmp_path / "current", jax="0.12.1", jaxlib="0.12.1")
    out = _dry_run(python, wheel, tmp_path, env)
    assert out.returncode == 0, out.stderr
    assert [i["metadata"]["name"] for i in json.loads(out.stdout)["install"]] == ["zerojax"]
    # Control: pip does see the fake versions, since one past the range is refused.
    env = _fake_installed(tmp_path / "past", jax=str(ceiling), jaxlib=str(ceiling))
    out = _dry_run(python, wheel, tmp_path, env)
    assert out.returncode != 0 and "requirement jax" in out.stderr, out.stdout + out.stderr
