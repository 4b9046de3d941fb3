"""A reward worker process: ``python -m dora_jax.data.reward_worker SPEC``.

It loads the reward function ``SPEC`` names, says ``{"ready": true}`` (or ``{"fatal": why}``),
then reads one JSON request per line on stdin (``{"id", "response", "answer", "metadata"}``) and
answers each with one JSON line: ``{"id", "score", "metrics"}``, or ``{"id", "error", "message"}``
where ``error`` is ``exception`` (the function raised) or ``invalid`` (it returned junk). Plain
JSON both ways: nothing received is unpickled or run. What the function prints goes to stderr,
so it cannot corrupt the answers.
"""

from __future__ import annotations

import json
import sys

from dora_jax.worker_process import answers


def main(spec: str) -> int:
    send = answers()  # the answers' channel; prints go to stderr

    from dora_jax.data.reward_functions import InvalidReward, arity, call, load_reward_function
    from dora_jax.data.reward_functions import outcome as to_outcome

    try:
        fn = load_reward_function(spec)
        n_args = arity(fn)
    except Exception as e:  # the spec or the user's module is broken: say why and stop
        send({"fatal": f"{type(e).__name__}: {e}"})
        return 1
    send({"ready": True})
    for line in sys.stdin:
        job = json.loads(line)
        try:
            value = call(fn, n_args, job["response"], job["answer"], job["metadata"])
            score, metrics = to_outcome(value)
        except InvalidReward as e:
            send({"id": job["id"], "error": "invalid", "message": str(e)})
        except Exception as e:  # a user function may raise anything: reported, not fatal
            send({"id": job["id"], "error": "exception", "message": f"{type(e).__name__}: {e}"})
        else:
            send({"id": job["id"], "score": score, "metrics": metrics})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
