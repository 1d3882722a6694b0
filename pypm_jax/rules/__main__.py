"""``python -m pypm_jax.rules --regenerate``: rebuild the standard rules' shipped data
(``pypm_jax/rules/_prebuilt.pypm``) from their sources, and the digest pinning it
(``_prebuilt_digest.py``); ``--check`` only says whether both are current and the data loads
with every check (exit status 1 when not)."""

from __future__ import annotations

import argparse
import sys

from . import _prebuilt, standard_rules


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pypm_jax.rules", description=__doc__)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--regenerate", action="store_true", help="rewrite the shipped data")
    what.add_argument("--check", action="store_true", help="exit 1 if it is not current")
    args = ap.parse_args(argv)
    rules = standard_rules()
    if args.check:
        problem = _prebuilt.check(rules)
        if problem is None:
            print(f"{_prebuilt.DATA_PATH}: current")
            return 0
        print(f"{_prebuilt.DATA_PATH}: stale ({problem}); run {_prebuilt.REGENERATE}")
        return 1
    changed = _prebuilt.regenerate(rules)
    print(f"{_prebuilt.DATA_PATH}: {'rewritten' if changed else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
