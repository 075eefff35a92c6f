"""Moved to :mod:`spanrl.core.settings` (spanrl/core/settings.py, the ground floor the services share).

This name stays an alias of that very module (not a copy: one set of globals) for code and
commands written before the move, e.g. ``python -m spanrl.infra.settings``. New code imports
``spanrl.core.settings``.
"""
import sys

from spanrl.core import settings as _moved

if __name__ == "__main__":
    _moved.main()
else:
    sys.modules[__name__] = _moved
