"""Command line (cli): prepare the offline SmolLM2 cache once.

CLI layer (entry points): nothing in the package imports it.

    python -m a3po_jax.cli.assets prepare-smollm2 [--cache-dir DIR] [--force]
    python -m a3po_jax.cli.assets locate-smollm2

What the cache holds and where it lives is in `a3po_jax.model.assets`.
"""

from __future__ import annotations

import argparse
import sys

from a3po_jax.model import assets

PROG = "python -m a3po_jax.cli.assets"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=assets.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare-smollm2", help="write the SmolLM2 cache folder once")
    prep.add_argument("--cache-dir", default=None, help=f"default {assets.smollm2_cache_dir()}")
    prep.add_argument("--force", action="store_true", help="rebuild even if prepared")
    sub.add_parser("locate-smollm2", help="print the path of the shipped GGUF")
    args = parser.parse_args(argv)
    if args.command == "locate-smollm2":
        print(assets.smollm2_gguf_path())
        return 0
    print(assets.prepare_smollm2(args.cache_dir, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
