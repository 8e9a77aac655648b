"""Silence known third-party deprecation warnings that fill the first screen of every run.

Called by the entry points only: tests and library users still see every warning.
"""

from __future__ import annotations

import re
import warnings

# (message regex, category): deprecations inside dependencies that we cannot act on.
KNOWN = (
    # torchdata's StatefulDataLoader calls torch.set_vital, deprecated in torch 2.x
    (r"'set_vital' is deprecated", UserWarning),
    # Lightning's pytree helper still builds torch's deprecated LeafSpec
    (re.escape("`isinstance(treespec, LeafSpec)` is deprecated"), FutureWarning),
)


def quiet_known_warnings() -> None:
    """Ignore the ``KNOWN`` warnings for this process (child processes inherit none of it)."""
    for message, category in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category)
