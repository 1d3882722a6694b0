"""Hypothesis budgets, one per profile; ``PYPM_HYPOTHESIS_PROFILE`` picks the profile.

- ``ci``: CI's budget (the acceptance criteria's example counts); what ``make test`` runs, and
  the default when ``CI`` is set;
- ``dev``: a tenth of it, the default of a plain ``pytest`` run;
- ``fast``: a smoke budget for ``make test-fast``.

A test that needs its own count asks :func:`examples` for it, per profile.
"""

from __future__ import annotations

import os

# max_examples of a property test that sets no count of its own
MAX_EXAMPLES = {"ci": 2000, "dev": 200, "fast": 20}


def profile() -> str:
    """The profile of this run: ``PYPM_HYPOTHESIS_PROFILE``, else ``ci`` under CI, else ``dev``."""
    name = os.environ.get("PYPM_HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    if name not in MAX_EXAMPLES:
        raise ValueError(
            f"PYPM_HYPOTHESIS_PROFILE={name!r}: expected one of {', '.join(MAX_EXAMPLES)}"
        )
    return name


def examples(*, ci: int, dev: int, fast: int) -> int:
    """A test's own example count under the current profile."""
    return {"ci": ci, "dev": dev, "fast": fast}[profile()]
