"""zerojax's command-line tools, apart from the library's core modules.

- :mod:`zerojax.cli.command`: the ``zerojax`` command (``estimate``, ``plan``, ``train``,
  ``bench``, ``export``, ``tune``, ``launch``), installed as a console script; also
  ``python -m zerojax.cli``.
- :mod:`zerojax.cli.demo`: ``zerojax train``, the demo (a character-level GPT on the
  Python standard library's source).
- :mod:`zerojax.cli.bench`: ``zerojax bench``, the side-by-side benchmark.
- :mod:`zerojax.cli.launch`: ``zerojax launch`` (also ``python -m zerojax.launch`` and
  ``python -m zerojax.cli.launch``), several processes on one machine for a
  multi-process job.
- :mod:`zerojax.cli.tune`: ``zerojax tune``, compile and time the configurations the
  planner says fit, and recommend the measured fastest.
- :mod:`zerojax.cli.plan_text`: the planner's text (``zerojax plan``'s tables and
  recommendation, ``zerojax estimate --table1``), on top of
  :mod:`zerojax.analysis.plan`'s data.
- :mod:`zerojax.cli.args`: argument types and tables they share.

Nothing here is imported by ``import zerojax``.
"""

import importlib

from zerojax.cli.command import build_parser, main

__all__ = ["main", "build_parser"]
_SUBMODULES = ("args", "bench", "command", "demo", "launch", "plan_text", "tune")


def __getattr__(name):
    # `zerojax.cli.launch` etc. as attributes, imported on first use (demo and bench
    # import jax and the models; the console script's --help should not wait for them)
    if name in _SUBMODULES:
        return importlib.import_module(f"zerojax.cli.{name}")
    raise AttributeError(f"module 'zerojax.cli' has no attribute {name!r}")
