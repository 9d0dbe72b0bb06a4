#!/usr/bin/env python3
"""Write the small deterministic GGUF models of fleetd.models (see there for what they are).

scripts/make-models.py [--out DIR] [--arch llama,qwen3,qwen3moe,gemma3] [--types f32,f16,q8_0,q4_k]
                       [--size tiny|bench|mid|wide|wide12|load|hash|hash2|stage]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fleetd.models import ARCHS, FILE_TYPES, SIZES, generate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path.home() / ".cache" / "fleetd" / "models"))
    ap.add_argument("--arch", default=",".join(ARCHS))
    ap.add_argument("--types", default=",".join(FILE_TYPES))
    ap.add_argument(
        "--size",
        default="tiny",
        choices=sorted(SIZES),
        help="tiny: tests; bench: benchmarks; wide: the lab; load: benchmarks/load.py; hash: its test; "
        "stage: benchmarks/stage_lab.py (~680 MB f16)",
    )
    args = ap.parse_args()
    for arch in args.arch.split(","):
        for type_name in args.types.split(","):
            print(generate(arch, type_name, Path(args.out), args.size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
