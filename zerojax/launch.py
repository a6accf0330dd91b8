"""``python -m zerojax.launch``: the multi-process launcher under the name earlier
docs and job scripts use; the same as ``zerojax launch`` and
``python -m zerojax.cli.launch`` (:mod:`zerojax.cli.launch`, where it lives)::

    python -m zerojax.launch --nproc 2 --devices-per-proc 4 train.py --stage 3
"""

from zerojax.cli.launch import build_parser, launch, main

__all__ = ["build_parser", "launch", "main"]

if __name__ == "__main__":
    main(prog="python -m zerojax.launch")
