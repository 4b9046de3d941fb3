"""An environment worker process: ``python -m dora_jax.envs.worker SPEC KWARGS_JSON``.

It loads the class ``SPEC`` names and builds one instance with the keyword arguments (a broken
spec or constructor is ``{"fatal": why}``), says ``{"ready": true, "stop": [...]}``, then serves
one JSON request per line on stdin, each about one episode it holds (one fresh instance per
episode):

- ``{"id", "op": "reset", "episode", "seed", "task"}`` and ``{"id", "op": "step", "episode",
  "action"}`` are answered ``{"id", "result": {...}, "digest"}`` or ``{"id", "error",
  "message"}`` with ``error`` ``exception`` (the environment raised) or ``invalid`` (it returned
  junk, :mod:`dora_jax.envs.protocol`). ``digest`` chains every result of the episode so far.
- a ``step`` may carry ``"rebuild": {"seed", "task", "actions", "digest"}``: the episode lived on
  a worker that was stopped, so it is replayed here first; a replay whose digest differs (the
  environment is not a pure function of seed, task and actions) fails ``crash``. A replay that
  succeeds is reported ``{"id", "rebuilt": true}`` before the step runs, so that the step's own
  timeout starts then.
- ``{"op": "close", "episode"}`` drops an episode; it has no answer.

Plain JSON both ways; what the environment prints goes to stderr.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from dora_jax.envs.protocol import InvalidEnvReturn, Step, check_reset, check_step
from dora_jax.user_code import invoke
from dora_jax.worker_process import answers


def chain(digest: str, step: Step) -> str:
    """The episode digest after ``step`` (info is left out: it may hold timings)."""
    item = [step.observation, step.reward, step.terminated, step.truncated]
    return hashlib.sha1((digest + json.dumps(item, sort_keys=True)).encode()).hexdigest()


class _Episode:
    def __init__(self, env: Any):
        self.env = env
        self.digest = ""

    def reset(self, seed: int, task: dict) -> Step:
        step = check_reset(invoke(self.env.reset, seed, task))
        self.digest = chain("", step)
        return step

    def step(self, action: str) -> Step:
        step = check_step(invoke(self.env.step, action))
        self.digest = chain(self.digest, step)
        return step


class _ReplayMismatch(Exception):
    pass


def main(spec: str, kwargs_json: str) -> int:
    send = answers()  # the answers' channel; prints go to stderr

    from dora_jax.envs.loading import load_environment_class, make_environment
    from dora_jax.envs.protocol import stop_strings

    kwargs = json.loads(kwargs_json)
    try:
        cls = load_environment_class(spec)
        stop = stop_strings(make_environment(cls, kwargs, spec))
    except Exception as e:  # the spec or the user's module is broken: say why and stop
        send({"fatal": str(e) if e.args else type(e).__name__})
        return 1
    send({"ready": True, "stop": list(stop)})
    episodes: dict[int, _Episode] = {}
    for line in sys.stdin:
        job = json.loads(line)
        eid = job["episode"]
        if job["op"] == "close":
            episodes.pop(eid, None)
            continue
        try:
            if job["op"] == "reset":
                ep = episodes[eid] = _Episode(cls(**kwargs))
                result = ep.reset(job["seed"], job["task"])
            else:
                if "rebuild" in job:
                    episodes[eid] = _rebuild(cls(**kwargs), job["rebuild"])
                    send({"id": job["id"], "rebuilt": True})
                result = episodes[eid].step(job["action"])
        except _ReplayMismatch as e:
            episodes.pop(eid, None)
            send({"id": job["id"], "error": "crash", "message": str(e)})
        except InvalidEnvReturn as e:
            episodes.pop(eid, None)
            send({"id": job["id"], "error": "invalid", "message": str(e)})
        except Exception as e:  # an environment may raise anything: reported, not fatal
            episodes.pop(eid, None)
            send({"id": job["id"], "error": "exception", "message": f"{type(e).__name__}: {e}"})
        else:
            send({"id": job["id"], "result": result.to_json(), "digest": episodes[eid].digest})
    return 0


def _rebuild(env: Any, rebuild: dict) -> _Episode:
    ep = _Episode(env)
    try:
        ep.reset(rebuild["seed"], rebuild["task"])
        for action in rebuild["actions"]:
            ep.step(action)
    except Exception as e:  # the replay itself failed
        raise _ReplayMismatch(
            f"the episode could not be rebuilt on a fresh worker: replaying "
            f"its actions raised {type(e).__name__}: {e}"
        ) from None
    if ep.digest != rebuild["digest"]:
        raise _ReplayMismatch(
            "the episode could not be rebuilt on a fresh worker: replaying its "
            "actions gave other results (the environment is not a pure "
            "function of seed, task and actions)"
        )
    return ep


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
