"""fleetctl model make: the small deterministic GGUF models fleetd's tests, demo and benchmarks
use (fleetd.models), for trying a fleet without downloading weights."""

from __future__ import annotations

import json
from pathlib import Path

from fleetd.errors import UsageError
from fleetd.models import ARCHS, FILE_TYPES, SIZES, generate

MODEL_HELP = "make a small deterministic GGUF test model (no download): llama, qwen3, qwen3moe, gemma3"
DEFAULT_DIR = Path.home() / ".cache" / "fleetd" / "models"


def configure_model(p) -> None:
    """The flags of `fleetctl model make`."""
    sub = p.add_subparsers(dest="model_action", metavar="ACTION", required=True)
    make = sub.add_parser("make", help=MODEL_HELP, description=MODEL_HELP)
    make.add_argument("--arch", default="llama", help=f"one of {', '.join(ARCHS)} (default llama)")
    make.add_argument(
        "--type",
        dest="type_name",
        default="q8_0",
        help=f"weight type, one of {', '.join(FILE_TYPES)} (default q8_0)",
    )
    make.add_argument(
        "--size",
        default="tiny",
        help=f"one of {', '.join(SIZES)} (default tiny: seconds on two cores; bench: ~100M parameters)",
    )
    make.add_argument(
        "--dir", type=Path, default=DEFAULT_DIR, help=f"where to write it (default {DEFAULT_DIR})"
    )
    make.add_argument("--json", action="store_true", help='print {"path": ...} instead of the path')


def cmd_model(args) -> int:
    try:  # written once, reused after: the same bytes for the same name on any machine
        path = generate(args.arch, args.type_name, args.dir, args.size)
    except ValueError as exc:  # an unknown arch, type or size: the operator's input
        raise UsageError(str(exc)) from None
    print(json.dumps({"path": str(path), "bytes": path.stat().st_size}) if args.json else path)
    return 0
