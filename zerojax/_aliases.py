"""The old flat module names (before issue 43's re-layout) as aliases of the moved
modules: ``import zerojax.step``, ``from zerojax.step import build_train_step``,
``from zerojax import step``, ``monkeypatch.setattr("zerojax.checkpoint.x", ...)`` and
pickles naming ``zerojax.<old>`` reach the same module object as
``zerojax.engine.step`` (docs/architecture.md,
"Where things moved"). No file per old name: :class:`AliasFinder`, first on
``sys.meta_path`` once ``zerojax`` is imported, answers an old name by importing the
new one."""

import importlib
import importlib.abc
import importlib.util
import sys

# old module name under zerojax -> the package it moved to
MOVED = {
    "compat": "core",
    "mesh": "core",
    "partition": "core",
    "state": "core",
    "quant": "core",
    "activations": "core",
    "tiling": "core",
    "modelspec": "core",
    "collectives": "core",
    "schedule": "core",
    "launchers": "runtime",
    "preemption": "runtime",
    "distributed": "runtime",
    "hostmem": "runtime",
    "nvme_lock": "runtime",
    "offload": "tiers",
    "nvme": "tiers",
    "step": "engine",
    "nvme_step": "engine",
    "formats": "io",
    "load": "io",
    "checkpoint_reader": "io",
    "checkpoint_publish": "io",
    "checkpoint_state": "io",
    "checkpoint_nvme": "io",
    "export": "io",
    "checkpoint": "io",
    "config": "api",
    "optimizer_layout": "api",
    "optimizer_init": "api",
    "optimizer_handback": "api",
    "optimizer_tx": "api",
    "optimizer": "api",
}
PACKAGES = ("core", "runtime", "tiers", "engine", "io", "api")  # the layer packages, bottom first
ALIASES = {f"zerojax.{old}": f"zerojax.{package}.{old}" for old, package in MOVED.items()}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the already-importable new module (no second copy)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._spec = module.__spec__  # the import system sets __spec__ to the alias's
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec  # put the module's own spec back (reload, pickle)


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``zerojax.<old>`` as the module it moved to (:data:`ALIASES`)."""

    def find_spec(self, fullname, path=None, target=None):
        new = ALIASES.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
