#!/usr/bin/env python
"""Generate text with jaxspec from the command line: `jaxspec generate` (jaxspec/cli.py), run from a checkout.

    python scripts/generate.py "def fibonacci(n):"
    python scripts/generate.py --chat "Write a haiku about JAX." --temperature 0.7 --seed 1
"""

from __future__ import annotations

import sys

from jaxspec.cli import generate_main


def main(argv=None) -> int:
    return generate_main(argv, prog="scripts/generate.py")


if __name__ == "__main__":
    sys.exit(main())
