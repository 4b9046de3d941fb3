"""Write a word-arithmetic task's training and held-out JSONL files (``What is 13 + 14?``).

    python launch/make_word_arithmetic.py --op + --lo 1 --hi 50 --train 2000 --held-out 200 \\
        --out configs/recipes/data/add-1-50

writes ``train.jsonl`` and ``held_out.jsonl`` under ``--out``: seeded, disjoint (no operand pair
of the held-out set is trained on), one ``{"prompt", "answer", "op", "a", "b"}`` row a line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dora_jax.data.word_arithmetic import OPS, pairs_of, problems  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=sorted(OPS), default="+")
    p.add_argument("--lo", type=int, default=1)
    p.add_argument("--hi", type=int, default=50)
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--seed", type=int, default=7, help="the held-out set's; training uses seed+1")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    held = problems(args.op, args.lo, args.hi, args.held_out, args.seed)
    train = problems(args.op, args.lo, args.hi, args.train, args.seed + 1, exclude=pairs_of(held))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("held_out.jsonl", held)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {out / name} ({len(rows)} problems)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
