"""The base model on candidate tasks, before any training: which task and difficulty can show
learning. For each candidate (operation and operand range of ``dora_jax.data.word_arithmetic``),
the model answers the same held-out problems through its chat template with our engine, greedy
(and, with ``--samples``, at temperature 1), and the JSON records per candidate:

- ``pass@1``: the share of responses whose last number is the answer and that ended on their own
  (``data.reward: final_number``'s full credit, the recipe's held-out figure);
- ``correct``: the last number is right, ended or not; ``ended``: an EOS before the token limit;
- ``format``: ended with a number in the response; two sample responses.

A recipe's task is one whose greedy pass@1 lies between 5% and 60% (room to learn, and a
signal to learn from). Accuracy figures do not depend on the machine's load; its seconds do.

    python benchmarks/smollm2_baseline.py --model models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dora_jax.platform import fake_cpu_devices  # noqa: E402

fake_cpu_devices(2)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from quiet import add_arguments, provenance, rel, wait_for_quiet  # noqa: E402

from dora_jax.config import RolloutConfig  # noqa: E402
from dora_jax.data.examples import Example  # noqa: E402
from dora_jax.data.rewards import final_number, final_number_reward  # noqa: E402
from dora_jax.data.word_arithmetic import problems  # noqa: E402
from dora_jax.model.hf_checkpoint import load_hf_config, load_hf_params  # noqa: E402
from dora_jax.model.tokenizer import HFTokenizer  # noqa: E402
from dora_jax.pipeline.evaluation import Evaluator  # noqa: E402

CANDIDATES = [("+", 1, 20), ("+", 10, 99), ("-", 1, 20), ("*", 2, 12), ("*", 10, 30)]
HELD_OUT_SEED = 7


def measure(
    model_dir: Path, op: str, lo: int, hi: int, n: int, temperature: float, max_new: int
) -> dict:
    cfg = load_hf_config(model_dir, hf_path=str(model_dir))
    tok = HFTokenizer(model_dir)
    rows = problems(op, lo, hi, n, HELD_OUT_SEED)
    seen: list[dict] = []

    def score(response: str, answer: str, metadata: dict) -> dict:
        out = final_number_reward(response, answer, metadata)
        seen.append(
            {**out, "number": float(final_number(response) is not None), "response": response}
        )
        return out

    rollout = RolloutConfig(
        max_prompt_len=96,
        max_new_tokens=max_new,
        page_size=16,
        temperature=temperature,
        max_slots=n,
        num_pages=8,
    )
    params = load_hf_params(model_dir, cfg)
    ev = Evaluator(
        cfg,
        rollout,
        jax.devices()[0],
        tok,
        [Example(r["prompt"], r["answer"], {}) for r in rows],
        score,
        seed=0,
    )
    t0 = time.perf_counter()
    result = ev(params, 0)
    seconds = time.perf_counter() - t0
    pick = lambda k: float(np.mean([s[k] for s in seen]))  # noqa: E731
    return {
        "op": op,
        "lo": lo,
        "hi": hi,
        "problems": n,
        "temperature": temperature,
        "pass@1": result.solved,
        "correct": pick("correct"),
        "ended": pick("ended"),
        "format": float(np.mean([s["ended"] * s["number"] for s in seen])),
        "mean_response_tokens": result.response_len,
        "seconds": seconds,
        "examples": [
            {"prompt": r["prompt"], "answer": r["answer"], "response": s["response"]}
            for r, s in list(zip(rows, seen, strict=True))[:2]
        ],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--problems", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--samples", action="store_true", help="also at temperature 1")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "smollm2_baseline.json"))
    add_arguments(p, max_load=100.0)  # accuracy does not depend on the load
    args = p.parse_args(argv)
    load = wait_for_quiet(args.max_load, args.wait)
    model = Path(args.model)
    temps = (0.0, 1.0) if args.samples else (0.0,)
    rows = []
    for op, lo, hi in CANDIDATES:
        for t in temps:
            r = measure(model, op, lo, hi, args.problems, t, args.max_new_tokens)
            rows.append(r)
            print(
                f"{op} [{lo}, {hi}] T={t}: pass@1 {r['pass@1']:.3f} correct {r['correct']:.3f} "
                f"ended {r['ended']:.3f} format {r['format']:.3f} "
                f"({r['mean_response_tokens']:.1f} tokens, {r['seconds']:.0f} s)",
                flush=True,
            )
    out = {
        "what": "SmolLM2-135M-Instruct (4-bit round trip) before training, greedy on "
        "held-out word-arithmetic problems, through its chat template",
        "model": rel(model),
        "max_new_tokens": args.max_new_tokens,
        "candidates": rows,
        **provenance(load),
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {rel(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
