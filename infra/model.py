"""Moved to :mod:`spanrl.core.model` (spanrl/core/model.py, the ground floor the services share).

This name stays an alias of that very module (not a copy: one set of globals) for code and
commands written before the move, e.g. ``python -m spanrl.infra.model``. New code imports
``spanrl.core.model``.
"""
import sys

from spanrl.core import model as _moved

if __name__ == "__main__":
    _moved.main()
else:
    sys.modules[__name__] = _moved
