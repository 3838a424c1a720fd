"""Warnings that point at the user's line.

Every warning the binding raises names the first frame outside the zopt
package (the user's call), however many of zopt's own frames (decorators,
helpers, the linked parts of a MixedOptimizer) lie between: a fixed
``stacklevel`` breaks each time a call path changes."""
from __future__ import annotations

import os
import sys
import warnings

_PKG = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message, category=UserWarning):
    """warnings.warn(message, category) attributed to the user's frame."""
    level = 2  # 1 is this function
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PKG):
        f = f.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
