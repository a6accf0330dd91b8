"""Issue 43's package re-layout: the flat modules of zerojax/ moved into layer packages
(core/, runtime/, tiers/, engine/, io/, api/) and every old name still imports as the
same module object (zerojax/_aliases.py); the README's imports and ``zerojax.__all__``
are unchanged; the library imports by the new names only; no new flat module."""

import ast
import importlib
import pickle
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from helpers import child_env

import zerojax
from zerojax import _aliases

PACKAGE = Path(zerojax.__file__).parent
ROOT = Path(__file__).resolve().parents[1]

# zerojax/'s flat modules as of c66d049 (before the move), written out so that the alias
# table cannot silently lose one
OLD_FLAT = [
    "activations", "checkpoint", "checkpoint_nvme", "checkpoint_publish", "checkpoint_reader",
    "checkpoint_state", "collectives", "compat", "config", "distributed", "export", "formats",
    "hostmem", "launchers", "load", "mesh", "modelspec", "nvme", "nvme_lock", "nvme_step",
    "offload", "optimizer", "optimizer_handback", "optimizer_init", "optimizer_layout",
    "optimizer_tx", "partition", "preemption", "quant", "schedule", "state", "step", "tiling",
]
# zerojax.__all__ on main before the move
ALL_BEFORE = ["make_mesh", "zero", "ZeroOptimizer", "ZeroConfig", "TrainState",
              "estimate_memory", "comm_volume", "plan", "memory_report",
              "CheckpointManager", "export_params", "load_params", "load_hf"]
# the files left in zerojax/ itself: the package, the alias table, `python -m zerojax.launch`
FLAT_FILES = {"__init__.py", "_aliases.py", "launch.py"}


def test_the_table_keeps_every_old_name():
    assert sorted(_aliases.MOVED) == sorted(OLD_FLAT)
    assert set(_aliases.MOVED.values()) == set(_aliases.PACKAGES)


@pytest.mark.parametrize("old", sorted(set(OLD_FLAT) | set(_aliases.MOVED)))
def test_old_name_is_the_moved_module(old):
    """``import zerojax.<old>``, ``from zerojax import <old>`` and the attribute after a
    plain ``import zerojax`` are the module in its package, one object."""
    new = importlib.import_module(f"zerojax.{_aliases.MOVED[old]}.{old}")
    assert new.__name__ == f"zerojax.{_aliases.MOVED[old]}.{old}"
    assert (PACKAGE / _aliases.MOVED[old] / f"{old}.py").is_file()
    assert importlib.import_module(f"zerojax.{old}") is new
    assert sys.modules[f"zerojax.{old}"] is new
    assert getattr(zerojax, old) is new
    namespace = {}
    exec(f"from zerojax import {old} as m", namespace)
    assert namespace["m"] is new
    assert new.__spec__.name == new.__name__  # its own spec, not the alias's


def test_an_old_name_first_in_a_fresh_process():
    """Imported by the old name before anything imported the new one, in a new
    interpreter: one module object under both names, ``python -m`` of the CLI launcher by
    its old name too."""
    code = ("import sys, zerojax.step as a, zerojax.checkpoint as c\n"
            "from zerojax.step import build_train_step\n"
            "import zerojax.engine.step as b, zerojax.io.checkpoint as d\n"
            "assert a is b and c is d and build_train_step is b.build_train_step\n"
            "assert sum(m.__name__ == 'zerojax.engine.step' for m in sys.modules.values()"
            " if m is not None and hasattr(m, '__name__')) == 2\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=child_env(JAX_PLATFORMS="cpu"), timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_monkeypatch_and_mock_by_the_old_names_reach_the_moved_module(monkeypatch):
    from zerojax.engine import step
    from zerojax.io import checkpoint

    sentinel = object()
    monkeypatch.setattr("zerojax.checkpoint._paths", sentinel)
    assert checkpoint._paths is sentinel
    monkeypatch.undo()
    assert checkpoint._paths is not sentinel
    monkeypatch.setattr(zerojax.step, "check_batch", sentinel)
    assert step.check_batch is sentinel
    monkeypatch.undo()
    with mock.patch("zerojax.step.check_batch", sentinel):
        assert step.check_batch is sentinel
    assert step.check_batch is not sentinel


def test_pickles_naming_old_modules_load():
    """A class pickled before the move (stored as ``zerojax.state.TrainState``) unpickles
    as the moved class; a new pickle names the new module."""
    from zerojax.core.state import TrainState

    old = b"czerojax.state\nTrainState\n."  # protocol 0: GLOBAL module name, STOP
    assert pickle.loads(old) is TrainState
    assert b"zerojax.core.state" in pickle.dumps(TrainState)


def test_unknown_names_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("zerojax.no_such_module")
    with pytest.raises(AttributeError, match="no_such_name"):
        zerojax.no_such_name  # noqa: B018


def test_all_unchanged():
    assert zerojax.__all__ == ALL_BEFORE
    for name in ALL_BEFORE:
        assert getattr(zerojax, name) is not None


def test_no_flat_module_left_in_the_package():
    """A new module goes into its layer's package (docs/architecture.md, "Layers")."""
    flat = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in FLAT_FILES)
    assert not flat, (f"modules directly in zerojax/: {flat}; move each into its layer's "
                      "package (core/, runtime/, tiers/, engine/, io/, api/, ...)")


def _old_path_imports(source: str, where: str) -> list[str]:
    """``file:line`` of each import of a moved module by its old name in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + ([f"zerojax.{a.name}" for a in node.names]
                                     if node.module == "zerojax" else [])
        else:
            continue
        if any(n.split(".")[:2] in (["zerojax", o] for o in _aliases.MOVED) for n in names):
            found.append(f"{where}:{node.lineno}")
    return found


def test_the_old_path_finder_names_a_planted_import():
    assert _old_path_imports("import os\nfrom zerojax import step as S, models\n"
                             "def f():\n    from zerojax.nvme import x\n", "f.py") == \
        ["f.py:2", "f.py:4"]
    assert _old_path_imports("from zerojax.engine import step\nimport zerojax", "f.py") == []


def test_the_library_imports_by_the_new_names():
    found = [hit for path in sorted(PACKAGE.rglob("*.py"))
             for hit in _old_path_imports(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, ("imports by an old module name inside zerojax/ (write the new one, "
                       "zerojax/_aliases.py's MOVED): " + ", ".join(found))


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _readme_names() -> list[tuple[str, str | None]]:
    """``(module, name)`` of each ``from zerojax... import name`` / ``import zerojax...``
    in the README's python blocks, parsed (a block that is not Python on its own is read
    line by line)."""
    found = set()
    for block in _readme_blocks():
        try:
            nodes = list(ast.walk(ast.parse(block)))
        except SyntaxError:
            nodes = []
            for line in block.splitlines():
                try:
                    nodes += list(ast.walk(ast.parse(line.strip())))
                except SyntaxError:
                    pass
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerojax"):
                found |= {(node.module, a.name) for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {(a.name, None) for a in node.names if a.name.startswith("zerojax")}
    return sorted(found, key=str)


def _readme_dotted() -> list[str]:
    """Each dotted ``zerojax.a.b`` the README names (``zerojax.distributed.initialize()``,
    ``zerojax.load.Into``): the old module names among them."""
    text = (ROOT / "README.md").read_text()
    return sorted({m.rstrip(".") for m in re.findall(r"(?<![\w/])zerojax(?:\.\w+)+", text)})


def test_readme_imports_are_found():
    names, dotted = _readme_names(), _readme_dotted()
    assert ("zerojax", None) in names and ("zerojax.models", "GPT") in names, names
    assert "zerojax.distributed.initialize" in dotted and len(dotted) > 10, dotted


@pytest.mark.parametrize("module, name", _readme_names())
def test_readme_import_resolves(module, name):
    mod = importlib.import_module(module)
    if name is not None:
        assert getattr(mod, name) is not None


@pytest.mark.parametrize("dotted", _readme_dotted())
def test_readme_dotted_name_resolves(dotted):
    """After ``import zerojax`` (a module by its old name included); a module not yet
    imported is imported, as ``pkgutil.resolve_name`` (mock.patch's) does."""
    import pkgutil

    assert pkgutil.resolve_name(dotted) is not None


def test_python_m_of_the_old_launcher_name():
    out = subprocess.run([sys.executable, "-m", "zerojax.launch", "--help"],
                         capture_output=True, text=True, env=child_env(JAX_PLATFORMS="cpu"),
                         timeout=300)
    assert out.returncode == 0 and "python -m zerojax.launch" in out.stdout, out.stderr[-2000:]
