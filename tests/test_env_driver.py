"""The turn driver and the prompt source of multi-turn runs (dora_jax/pipeline/conversations.py),
driven by a scripted engine over the character tokenizer (no model): prompt groups of
``tool_arithmetic`` played with the ideal actions end with reward 1, token-exact, the loss mask
on model tokens only; failing environments end their own conversation with reward 0, counted
once by kind; a driver saved with calls in flight goes on to the same tokens in a fresh pool;
drop, drift and budget errors; the prompt source's failures and long prompts; the factory."""

import json
import textwrap

import pytest
from envs_fixtures import local_reset, local_step

from dora_jax.config import load_config
from dora_jax.envs import EnvPool, EnvPoolError
from dora_jax.envs.builtin.calculator import ToolArithmetic
from dora_jax.envs.conversation import Limits
from dora_jax.execution.payloads import PromptPayload
from dora_jax.model.tokenizer import CharTokenizer
from dora_jax.pipeline.conversations import EnvPrompts, EnvTurnDriver, build_env
from dora_jax.pipeline.grpo import PromptTooLong

TOK = CharTokenizer()
LIMITS = Limits(max_turns=64, max_tokens=512, max_env_seconds=60.0)
MAX_PROMPT, MAX_NEW = 64, 448

SCRIPTED = textwrap.dedent("""
    import time

    class Scripted:
        '''Says "go:"; a turn "ok." is answered "more." (twice), then the episode ends with
        reward 1; "raise.", "hang." and "junk." misbehave, "caps." is answered in capitals.
        The reset of task 7 fails; task 3's first observation has 100 characters, task 11's is
        in capitals.'''

        stop_strings = (".",)

        def __init__(self, fail_all=False):
            self.fail_all = fail_all

        def reset(self, seed, task):
            if self.fail_all or task.get("index") == 7:
                raise KeyError("no task here")
            self.n = 0
            if task.get("index") == 3:
                return "x" * 100, {}
            if task.get("index") == 11:
                return "GO:", {"answer": "ok"}
            return "go:", {"answer": "ok"}

        def step(self, action_text):
            self.n += 1
            if action_text == "raise.":
                raise RuntimeError("the tool broke")
            if action_text == "hang.":
                time.sleep(60)
            if action_text == "junk.":
                return "more.", float("nan"), False, False, {}
            if action_text == "caps.":
                return "MORE.", 0.0, False, False, {}
            return "more.", float(self.n >= 3), self.n >= 3, False, {"n": self.n}
""")


@pytest.fixture(scope="module")
def arith_pool():
    pool = EnvPool("tool_arithmetic", {}, workers=2, timeout_s=20.0)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def scripted_spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs") / "scripted_env.py"
    path.write_text(SCRIPTED)
    return f"{path}:Scripted"


@pytest.fixture(scope="module")
def scripted_pool(scripted_spec):
    pool = EnvPool(scripted_spec, {}, workers=2, timeout_s=1.0)
    yield pool
    pool.close()


class Engine:
    """Stands in for the rollout engine: per request, the tokens after its prompt and their
    logprobs; a model turn is the encoding of a text; observations are appended as given."""

    def __init__(self, driver):
        self.driver = driver
        self.tokens, self.logprobs, self.model = {}, {}, {}
        self.prompts, self.over = {}, {}

    def submit(self, rid, payload):
        self.driver.begin(rid, payload)
        self.prompts[rid] = payload
        self.tokens[rid], self.logprobs[rid], self.model[rid] = [], [], []

    def turn(self, rid, text):
        ids = TOK.encode(text)
        start = len(self.tokens[rid])
        self.tokens[rid] += ids
        self.logprobs[rid] += [-0.01 * (rid + 1) - 0.001 * k for k in range(len(ids))]
        self.model[rid] += [True] * len(ids)
        self.driver.turn_ended(rid, list(self.tokens[rid]), list(self.logprobs[rid]), start)

    def settle(self, wait=True):
        outs = self.driver.outcomes(wait)
        for o in outs:
            if o.over:
                self.over[o.request_id] = o
            else:
                assert all(isinstance(t, int) for t in o.observation)
                self.tokens[o.request_id] += o.observation
                self.logprobs[o.request_id] += [0.0] * len(o.observation)
                self.model[o.request_id] += [False] * len(o.observation)
        return outs


def ideal_text_and_observations(index):
    """The whole conversation's text and the tool's answers, played in-process."""
    env = ToolArithmetic()
    text = local_reset(env, 0, {"index": index}).step.observation
    answers = []
    for action in env.ideal_actions(0, index):
        step = local_step(env, action).step
        text += action
        if not (step.terminated or step.truncated):
            answers.append(step.observation[0]["content"])
            text += answers[-1]
    return text, answers


def play_ideal(engine, rid, index, upto=None):
    """Play request ``rid`` (task ``index``) with the ideal actions, settling after each turn;
    stop before turn ``upto`` (leaving its call in flight after ``upto`` turns)."""
    actions = ToolArithmetic().ideal_actions(0, index)
    for k, action in enumerate(actions):
        engine.turn(rid, action)
        if upto is not None and k + 1 == upto:
            return
        engine.settle(wait=True)


def test_prompt_groups_played_ideally_end_with_reward_one_token_exactly(arith_pool):
    driver = EnvTurnDriver(arith_pool, TOK, LIMITS)
    prompts = EnvPrompts(arith_pool, TOK, LIMITS, MAX_PROMPT, MAX_NEW, seed=0)
    assert driver.stop_sequences == (tuple(TOK.encode("</call>")),)
    engine, group = Engine(driver), 3
    specs = [prompts.next_prompt() for _ in range(2)]
    assert prompts.state_dict()["cursor"] == 2 and arith_pool.live_episodes() == 0
    for g, spec in enumerate(specs):
        p = spec.payload
        assert p.index == g and spec.prompt_len == len(p.tokens)
        prompt_text = ToolArithmetic().prompt(0, g)[0]
        assert p.tokens == tuple(TOK.encode(prompt_text))
        assert p.max_new_tokens == min(MAX_NEW, LIMITS.max_tokens - len(p.tokens))
        c = p.conversation
        assert c["seed"] == 0 and c["task"] == {"index": g}
        assert c["observation"] == [{"role": "user", "content": prompt_text}]
        assert set(c["episode"]) == {"seed", "task", "actions", "digest"}
        json.dumps(c)  # plain data
        for m in range(group):
            engine.submit(g * group + m, p)
    assert arith_pool.live_episodes() == 2 * group  # each member adopted its own episode
    rounds = 0
    while len(engine.over) < 2 * group:  # every member takes its next turn, then all settle
        for rid in range(2 * group):
            if rid not in engine.over:
                actions = ToolArithmetic().ideal_actions(0, rid // group)
                engine.turn(rid, actions[driver._live[rid].conv.turns])
        assert driver.pending() == 2 * group - len(engine.over)
        engine.settle(wait=True)
        rounds += 1
    assert driver.pending() == 0 and driver.live() == 0 and arith_pool.live_episodes() == 0
    for rid, out in engine.over.items():
        index = rid // group
        text, answers = ideal_text_and_observations(index)
        prompt = list(engine.prompts[rid].tokens)
        assert prompt + engine.tokens[rid] == TOK.encode(text)  # the rendered conversation
        assert out.reward == 1.0 and out.loss_mask == tuple(engine.model[rid])
        assert sum(out.loss_mask) == sum(len(a) for a in ToolArithmetic().ideal_actions(0, index))
        f = out.figures
        assert f["end_reason"] == "terminated" and f["error"] is None
        assert f["turns"] == len(answers) + 1 and f["info/solved"] == 1.0
        assert f["tokens"] == len(prompt) + len(engine.tokens[rid])
    figures = driver.figures()
    assert figures["env/conversations"] == 6 and figures["env/end/terminated"] == 6
    assert figures["env/turns"] == sum(o.figures["turns"] for o in engine.over.values())
    assert all(figures[f"env/failures/{k}"] == 0 for k in ("timeout", "exception", "invalid"))
    assert rounds == max(o.figures["turns"] for o in engine.over.values())


def test_failing_calls_end_their_conversation_with_reward_zero_counted_once(scripted_pool, capsys):
    driver = EnvTurnDriver(scripted_pool, TOK, LIMITS)
    prompts = EnvPrompts(scripted_pool, TOK, LIMITS, MAX_PROMPT, MAX_NEW, seed=1)
    spec = prompts.next_prompt()
    assert spec.payload.answer == "ok" and driver.stop_sequences == ((TOK.encode(".")[0],),)
    errors_before = dict(scripted_pool.errors)
    engine = Engine(driver)
    kinds = {0: "ok.", 1: "raise.", 2: "hang.", 3: "junk.", 4: "ok."}
    for rid in kinds:
        engine.submit(rid, spec.payload)
    for rid, text in kinds.items():
        engine.turn(rid, text)
    outs = engine.settle(wait=True)
    assert [o.request_id for o in outs] == list(kinds)  # in the order the turns ended
    ended = {o.request_id: o for o in outs if o.over}
    assert set(ended) == {1, 2, 3}
    for rid, kind, reason in (
        (1, "exception", "env_error"),
        (2, "timeout", "env_timeout"),
        (3, "invalid", "env_error"),
    ):
        o = ended[rid]
        assert o.reward == 0.0 and o.figures["error"] == kind
        assert o.figures["end_reason"] == reason and o.loss_mask == (True,) * len(kinds[rid])
    grown = {k: v - errors_before.get(k, 0) for k, v in scripted_pool.errors.items()}
    assert {k: v for k, v in grown.items() if v} == {"exception": 1, "timeout": 1, "invalid": 1}
    # the others go on (those that shared the killed worker are rebuilt by replay)
    for _ in range(2):
        for rid in (0, 4):
            engine.turn(rid, "ok.")
        engine.settle(wait=True)
    assert engine.over[0].reward == 1.0 == engine.over[4].reward
    assert engine.prompts[0].tokens + tuple(engine.tokens[0]) == tuple(
        TOK.encode("go:ok.more.ok.more.ok.")
    )
    figures = driver.figures()
    assert figures["env/end/env_error"] == 2 and figures["env/end/env_timeout"] == 1
    assert figures["env/conversations"] == 5 and figures["env/end/terminated"] == 2
    assert figures["env/failures/exception"] >= 1 and figures["env/failures/timeout"] >= 1
    # an observation the tokenizer cannot encode is the episode's bad data: it ends as an
    # invalid call with reward 0, counted, and the first is printed naming the request
    for rid in (9, 10):
        engine.submit(rid, spec.payload)
        engine.turn(rid, "caps.")
    (nine, ten) = engine.settle(wait=True)
    for o in (nine, ten):
        assert o.over and o.reward == 0.0 and o.figures["error"] == "invalid"
        assert o.figures["end_reason"] == "env_error"
    after = driver.figures()
    assert after["env/failures/invalid"] == figures["env/failures/invalid"] + 2
    assert after["env/end/env_error"] == 4 and driver.live() == 0
    printed = capsys.readouterr().out
    assert printed.count("warning: env ") == 1, printed
    assert "request 9: its observation cannot be encoded: character 'M'" in printed
    # the counts survive a save: a restored driver goes on from them
    again = EnvTurnDriver(scripted_pool, TOK, LIMITS)
    again.load_state_dict(driver.state_dict())
    assert again.figures()["env/failures/invalid"] == after["env/failures/invalid"]


def test_a_saved_driver_goes_on_to_the_same_end_in_a_fresh_pool(arith_pool):
    driver = EnvTurnDriver(arith_pool, TOK, LIMITS)
    prompts = EnvPrompts(arith_pool, TOK, LIMITS, MAX_PROMPT, MAX_NEW, seed=0)
    prompts.load_state_dict({"cursor": 4, "skipped": 0, "failures": {}})
    spec = prompts.next_prompt()
    index = spec.payload.index
    actions = ToolArithmetic().ideal_actions(0, index)
    assert index == 4 and len(actions) >= 3
    engine = Engine(driver)
    for rid in range(3):
        engine.submit(rid, spec.payload)
    play_ideal(engine, 2, index, upto=1)
    engine.settle(wait=True)  # request 2 waits for the model
    play_ideal(engine, 0, index, upto=2)  # its second call in flight
    play_ideal(engine, 1, index, upto=1)  # its first call answered but not handed out
    driver._live[1].future.result(timeout=30)
    state = json.loads(json.dumps(driver.state_dict()))  # plain data
    assert state["calls"] == [0, 1]
    assert [c["action"] for c in state["conversations"]] == [actions[1], actions[0], None]
    fresh = EnvPool("tool_arithmetic", {}, workers=1, timeout_s=20.0)
    try:
        again = EnvTurnDriver(fresh, TOK, LIMITS)
        again.load_state_dict(state)
        assert again.pending() == 2 and fresh.live_episodes() == 3
        resumed = Engine(again)
        for rid in range(3):  # the engine's side of the checkpoint
            resumed.prompts[rid] = engine.prompts[rid]
            for name in ("tokens", "logprobs", "model"):
                getattr(resumed, name)[rid] = list(getattr(engine, name)[rid])
        # both go on: the saved driver in its pool, the restored one in the fresh pool
        for eng, drv in ((engine, driver), (resumed, again)):
            eng.settle(wait=True)
            while len(eng.over) < 3:
                for rid in range(3):
                    if rid not in eng.over:
                        eng.turn(rid, actions[drv._live[rid].conv.turns])
                eng.settle(wait=True)
        text, _ = ideal_text_and_observations(index)
        for rid in range(3):
            a, b = engine.over[rid], resumed.over[rid]
            assert a.reward == b.reward == 1.0 and a.loss_mask == b.loss_mask
            assert engine.tokens[rid] == resumed.tokens[rid]
            assert list(spec.payload.tokens) + resumed.tokens[rid] == TOK.encode(text)
        assert again.figures()["env/conversations"] == 3 and fresh.live_episodes() == 0
        assert again.figures()["env/turns"] == driver.figures()["env/turns"]
        again.begin(9, spec.payload)
        with pytest.raises(
            ValueError, match="needs a driver without conversations, this one has 1"
        ):
            again.load_state_dict(state)
        again.drop(9)
    finally:
        fresh.close()


def test_drop_drift_and_budget(arith_pool):
    driver = EnvTurnDriver(arith_pool, TOK, LIMITS)
    prompts = EnvPrompts(arith_pool, TOK, LIMITS, MAX_PROMPT, MAX_NEW, seed=0)
    spec = prompts.next_prompt()
    engine = Engine(driver)
    live_before = arith_pool.live_episodes()
    engine.submit(0, spec.payload)
    engine.turn(0, ToolArithmetic().ideal_actions(0, 0)[0])
    driver.drop(0)
    driver.drop(0)  # twice, or unknown: nothing
    assert driver.pending() == 0 and driver.outcomes(wait=True) == []
    assert arith_pool.live_episodes() == live_before and driver.figures()["env/dropped"] == 1
    # the engine's tokens drifted from the conversation's
    engine.submit(1, spec.payload)
    engine.turn(1, "<call>1-1</call>")
    engine.settle(wait=True)
    engine.tokens[1][0] += 1
    with pytest.raises(
        ValueError,
        match=r"request 1: the engine's \d+ tokens before this turn "
        r"are not .*\(first difference at 0\)",
    ):
        engine.turn(1, "#0")
    with pytest.raises(ValueError, match="request 5 has no conversation"):
        driver.turn_ended(5, [3], [0.0], 0)
    with pytest.raises(ValueError, match="request 1 already has a conversation"):
        driver.begin(1, spec.payload)
    c = spec.payload.conversation
    other = PromptPayload(0, spec.payload.tokens[:-1], "", 10, conversation=c)
    with pytest.raises(ValueError, match="differ from the payload's"):
        driver.begin(2, other)
    with pytest.raises(ValueError, match="no conversation"):
        driver.begin(3, PromptPayload(0, (3, 4), ""))
    driver.drop(1)
    # a turn over the request's budget ends the conversation max_tokens, with no call
    small = PromptPayload(0, spec.payload.tokens, "", 5, conversation=c)
    engine.submit(4, small)
    engine.turn(4, "<call>1-1</call>")
    (out,) = engine.settle(wait=False)
    assert out.over and out.figures["end_reason"] == "max_tokens" and out.reward == 0.0
    assert out.loss_mask == (True,) * len("<call>1-1</call>")
    # an environment turn that would leave no room for a model token ends it too
    roomy = PromptPayload(0, spec.payload.tokens, "", 20, conversation=c)
    engine.submit(6, roomy)
    engine.turn(6, "<call>100-1</call>")  # 18 tokens: the answer "99" does not fit in 2
    (out,) = engine.settle(wait=True)
    assert out.over and out.figures["end_reason"] == "max_tokens"
    assert driver.live() == 0 and arith_pool.live_episodes() == live_before


def test_prompt_source_failures_and_long_prompts(scripted_spec, scripted_pool):
    prompts = EnvPrompts(scripted_pool, TOK, LIMITS, MAX_PROMPT, MAX_NEW, seed=0)
    prompts.load_state_dict({"cursor": 7, "skipped": 0, "failures": {}})
    assert prompts.next_prompt().payload.index == 8  # task 7's reset failed: counted, skipped
    assert prompts.figures()["env/reset_failures/exception"] == 1
    # a first observation the tokenizer cannot encode is the task's bad data: a failed reset
    prompts.load_state_dict({"cursor": 11, "skipped": 0, "failures": {}})
    assert prompts.next_prompt().payload.index == 12
    assert prompts.figures()["env/reset_failures/invalid"] == 1
    prompts.load_state_dict({"cursor": 3, "skipped": 0, "failures": {}})
    with pytest.raises(
        PromptTooLong, match=r"task 3 has 100 tokens; rollout\.max_prompt_len is 64"
    ):
        prompts.next_prompt()
    skipping = EnvPrompts(scripted_pool, TOK, LIMITS, MAX_PROMPT, MAX_NEW, seed=0, skip=True)
    skipping.load_state_dict({"cursor": 3, "skipped": 0, "failures": {}})
    assert skipping.next_prompt().payload.index == 4
    assert skipping.state_dict() == {"cursor": 5, "skipped": 1, "failures": {}}
    broken = EnvPool(scripted_spec, {"fail_all": True}, workers=1, timeout_s=5.0)
    try:
        hopeless = EnvPrompts(broken, TOK, LIMITS, MAX_PROMPT, MAX_NEW, seed=0)
        line = (
            r"^env: .*scripted_env\.py:Scripted: 20 resets failed in a row \(tasks "
            r"0\.\.19\), the last exception: KeyError: 'no task here'$"
        )
        with pytest.raises(EnvPoolError, match=line):
            hopeless.next_prompt()
        assert hopeless.failures == {"exception": 20}
    finally:
        broken.close()


def test_build_env_from_the_config(tmp_path):
    assert build_env(load_config(), TOK) is None  # no env.spec: single-turn
    overrides = [
        "env.spec=tool_arithmetic",
        "env.workers=1",
        "env.max_turns=4",
        "env.kwargs.median_steps=2",
        "rollout.max_new_tokens=100",
    ]
    cfg = load_config(None, overrides)
    run = build_env(cfg, TOK)
    try:
        assert run.limits == Limits(max_turns=4, max_tokens=164, max_env_seconds=300.0)
        assert run.driver.stop_sequences == (tuple(TOK.encode("</call>")),)
        assert run.driver.env_rewards and run.pool.timeout_s == 30.0
        spec = run.prompts.next_prompt()
        assert spec.payload.max_new_tokens == 100
        names = {
            "env/conversations",
            "env/failures/timeout",
            "env/reset_failures/crash",
            "env/prompts_skipped",
        }
        assert set(run.figures()) >= names
        state = run.state_dict()
        assert state["prompts"]["cursor"] == 1 and state["driver"]["conversations"] == []
    finally:
        run.close()
    bad = tmp_path / "nothing.py"
    bad.write_text("x = 1\n")
    with pytest.raises(
        EnvPoolError,
        match=r"^environment workers cannot start: env: .*nothing"
        r"\.py has no class 'Nope'$",
    ):
        build_env(load_config(None, [f"env.spec={bad}:Nope", "env.workers=1"]), TOK)
