"""Token-exact conversations: at every model turn's start the incremental sequence equals the
chat template's rendering of the whole conversation, tokenized (checked against transformers'
own apply_chat_template for a Hugging Face tokenizer built offline, and against the plain rule
for the character tokenizer); the loss mask covers model tokens only; templates that rewrite
earlier turns are refused; each limit ends an episode with its reason."""

import math

import numpy as np
import pytest
from envs_fixtures import QWEN_STYLE, local_reset, local_step, write_bpe_tokenizer

from dora_jax.envs import EnvOutcome, Step
from dora_jax.envs.builtin.calculator import ToolArithmetic
from dora_jax.envs.builtin.guess import GuessNumbers
from dora_jax.envs.conversation import Conversation, Limits
from dora_jax.envs.rendering import RenderDriftError, TurnRenderer
from dora_jax.model.tokenizer import CharTokenizer, HFTokenizer

ROOMY = Limits(max_turns=1000, max_tokens=100_000)


def fake_logprobs(ids, turn):
    return [-0.01 * (turn + 1) - 0.001 * k for k in range(len(ids))]


def drive(conv, env, actions, tok, eos_each_turn, after_env=None):
    """Play ``actions`` as model turns (encoded, optionally closed by EOS), checking the
    sequence with ``after_env(conv)`` at every model turn's start."""
    sent = []
    for turn, action in enumerate(actions):
        if conv.done:
            break
        if after_env is not None:
            after_env(conv)
        ids = tok.encode(action) + ([tok.eos_id] if eos_each_turn else [])
        lp = fake_logprobs(ids, turn)
        sent.append((ids, lp))
        text = conv.add_model_turn(ids, lp)
        assert text == action
        conv.add_env_outcome(local_step(env, text))
    return sent


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.mark.parametrize("cls", [ToolArithmetic, GuessNumbers])
def test_char_tokenizer_sequence_is_the_plain_rendering(cls):
    tok, env = CharTokenizer(), cls()
    renderer = TurnRenderer(tok)
    assert not renderer.templated
    checks = []

    def plain(conv):  # no chat template: the contents in order, no markup
        assert conv.ids == tok.encode("".join(m["content"] for m in conv.messages))
        checks.append(len(conv.ids))

    for index in range(6):
        conv = Conversation.start(renderer, local_reset(env, 0, {"index": index}), ROOMY)
        prompt = env.prompt(0, index)[0]
        assert conv.ids == tok.encode(
            tok.apply_chat_template([{"role": "user", "content": prompt}])
        )
        drive(conv, env, env.ideal_actions(0, index), tok, eos_each_turn=False, after_env=plain)
        assert conv.end_reason == "terminated" and conv.reward() == 1.0
    assert len(checks) > 12


@pytest.mark.parametrize("eos_each_turn", [False, True])
@pytest.mark.parametrize("cls", [ToolArithmetic, GuessNumbers])
def test_hf_sequence_equals_transformers_rendering_of_the_whole_conversation(
    hf_dir, cls, eos_each_turn
):
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(str(hf_dir))
    tok, env = HFTokenizer(hf_dir), cls()
    renderer = TurnRenderer(tok)
    assert renderer.templated
    checked = []

    def whole(conv):
        want = oracle.apply_chat_template(conv.messages, add_generation_prompt=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert conv.ids == list(want)
        checked.append(len(conv.messages))

    for index in range(4):
        conv = Conversation.start(renderer, local_reset(env, 2, {"index": index}), ROOMY)
        drive(conv, env, env.ideal_actions(2, index), tok, eos_each_turn, after_env=whole)
        assert conv.end_reason == "terminated" and conv.reward() == 1.0
    assert max(checked) >= 5  # several environment turns were compared
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and tok.eos_id == im_end[0]


def test_loss_mask_and_logprobs_cover_model_tokens_only(hf_dir):
    tok, env = HFTokenizer(hf_dir), ToolArithmetic()
    conv = Conversation.start(TurnRenderer(tok), local_reset(env, 0, {"index": 1}), Limits())
    sent = drive(conv, env, env.ideal_actions(0, 1), tok, eos_each_turn=False)
    mask, ids = conv.loss_mask, conv.token_ids
    assert mask.shape == ids.shape and not mask[: conv.prompt_len].any()
    model_ids = np.concatenate([np.asarray(i) for i, _ in sent])
    np.testing.assert_array_equal(ids[mask], model_ids)  # the sampled ids, verbatim
    np.testing.assert_allclose(
        conv.model_logprobs, np.concatenate([lp for _, lp in sent]), rtol=0, atol=1e-7
    )
    assert (conv.behavior_logprobs[~mask] == 0).all()
    # every environment turn lies between model turns: the mask switches at each boundary
    switches = np.flatnonzero(np.diff(mask.astype(int)))
    assert len(switches) == 2 * len(sent) - 1
    summary = conv.summary()
    assert summary["model_tokens"] == len(model_ids) and summary["turns"] == len(sent)
    assert summary["env_tokens"] == len(ids) - conv.prompt_len - len(model_ids) > 0
    assert summary["info/solved"] == 1.0 and summary["end_reason"] == "terminated"


def test_sampled_ids_are_kept_even_when_they_tokenize_the_text_differently(hf_dir):
    tok, env = HFTokenizer(hf_dir), ToolArithmetic()
    conv = Conversation.start(TurnRenderer(tok), local_reset(env, 0, {"index": 2}), Limits())
    action = env.ideal_actions(0, 2)[0]
    odd = [i for ch in action for i in tok.encode(ch)]  # one id per character: not canonical
    assert odd != tok.encode(action)
    text = conv.add_model_turn(odd, [-1.0] * len(odd))
    assert text == action and conv.ids[conv.prompt_len :] == odd


def rewriting_template():
    # drops the reasoning of assistant turns that are not the last (as some templates do)
    return QWEN_STYLE.replace(
        "{{ m['content'] }}",
        "{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}",
    )


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    tok = HFTokenizer(write_bpe_tokenizer(tmp_path, rewriting_template()))
    env = GuessNumbers()
    conv = Conversation.start(TurnRenderer(tok), local_reset(env, 0, {"index": 0}), Limits())
    ids = tok.encode("<think>hello</think>8?")
    text = conv.add_model_turn(ids, [-1.0] * len(ids))
    with pytest.raises(RenderDriftError, match="rewrites earlier turns"):
        conv.add_env_outcome(local_step(env, text))
    # without reasoning in the turn, the same template renders exactly
    conv = Conversation.start(TurnRenderer(tok), local_reset(env, 0, {"index": 0}), Limits())
    ids = tok.encode("8?")
    conv.add_env_outcome(local_step(env, conv.add_model_turn(ids, [-1.0] * len(ids))))
    assert conv.awaiting == "model"


def test_a_template_that_does_not_close_turns_with_the_sampled_eos_is_refused(tmp_path):
    template = QWEN_STYLE.replace("<|im_end|>\n{% endfor %}", "<|endoftext|>\n{% endfor %}")
    tok = HFTokenizer(write_bpe_tokenizer(tmp_path, template))
    env = GuessNumbers()
    conv = Conversation.start(TurnRenderer(tok), local_reset(env, 0, {"index": 0}), Limits())
    ids = tok.encode("8?") + [tok.eos_id]
    text = conv.add_model_turn(ids, [-1.0] * len(ids))
    with pytest.raises(RenderDriftError, match="not with the EOS"):
        conv.add_env_outcome(local_step(env, text))


def scripted(observations, limits, seconds=0.0):
    """A conversation over the character tokenizer fed ``observations`` as environment steps."""
    tok = CharTokenizer()
    conv = Conversation.start(TurnRenderer(tok), EnvOutcome(Step("go:")), limits)
    for out in observations:
        if conv.done:
            break
        ids = tok.encode("ab")
        conv.add_model_turn(ids, [-0.5, -0.5])
        conv.add_env_outcome(
            out if isinstance(out, EnvOutcome) else EnvOutcome(out, None, "", seconds)
        )
    return conv


def ok(obs="x", reward=0.0, terminated=False, truncated=False):
    return Step(obs, reward, terminated, truncated)


@pytest.mark.parametrize(
    "limits, steps, reason, turns, reward",
    [
        (Limits(), [ok(), ok(reward=1.0, terminated=True)], "terminated", 2, 1.0),
        (Limits(), [ok(reward=0.5), ok(reward=0.25, truncated=True)], "truncated", 2, 0.75),
        (Limits(max_turns=3), [ok(reward=1.0)] * 10, "max_turns", 3, 3.0),
        (Limits(max_tokens=20), [ok("0123456789")] * 10, "max_tokens", 2, 0.0),
        (Limits(max_env_seconds=2.5), [ok()] * 10, "max_env_seconds", 3, 0.0),
        (Limits(), [ok(reward=1.0), EnvOutcome(None, "timeout", "slow")], "env_timeout", 2, 0.0),
        (Limits(), [ok(reward=1.0), EnvOutcome(None, "invalid", "nan")], "env_error", 2, 0.0),
    ],
)
def test_each_limit_ends_the_conversation_with_its_reason(limits, steps, reason, turns, reward):
    conv = scripted(steps, limits, seconds=1.0)
    assert conv.done and conv.end_reason == reason and conv.awaiting is None
    assert conv.turns == turns and math.isclose(conv.reward(), reward)
    assert len(conv.ids) < limits.max_tokens
    with pytest.raises(ValueError, match="not waiting for the model"):
        conv.add_model_turn([3], [0.0])


def test_reward_modes_failures_and_the_token_budget():
    conv = scripted([ok(reward=0.5), ok(reward=2.0, terminated=True)], Limits())
    assert (conv.reward("sum"), conv.reward("last")) == (2.5, 2.0)
    failed = scripted([ok(reward=1.0), EnvOutcome(None, "crash", "died")], Limits())
    assert failed.error == "crash" and failed.message == "died" and failed.reward() == 0.0
    conv = scripted([], Limits(max_tokens=10))
    assert conv.tokens_left == 10 - len("go:")
    with pytest.raises(ValueError, match="only 7 are left"):
        conv.add_model_turn(list(range(3, 11)), [0.0] * 8)
    bad_reset = Conversation.start(
        TurnRenderer(CharTokenizer()), EnvOutcome(None, "exception", "boom"), Limits()
    )
    assert bad_reset.end_reason == "env_error" and bad_reset.ids == []
    long_prompt = Conversation.start(
        TurnRenderer(CharTokenizer()), EnvOutcome(Step("x" * 10)), Limits(max_tokens=10)
    )
    assert long_prompt.end_reason == "max_tokens"


def test_a_conversation_saved_at_any_point_goes_on_to_the_same_end():
    import json

    tok, env = CharTokenizer(), ToolArithmetic()
    renderer = TurnRenderer(tok)
    actions = env.ideal_actions(0, 3)
    assert len(actions) >= 3

    def play(save_at):
        conv = Conversation.start(renderer, local_reset(env, 0, {"index": 3}), ROOMY)
        saved = 0
        for turn, action in enumerate(actions):
            ids = tok.encode(action)
            text = conv.add_model_turn(ids, fake_logprobs(ids, turn))
            if turn == save_at:  # awaiting the environment
                state = json.loads(json.dumps(conv.state_dict()))
                conv = Conversation.from_state(renderer, ROOMY, state)
                assert conv.awaiting == "env"
                saved += 1
            conv.add_env_outcome(local_step(env, text))
            if turn == save_at + 1 and not conv.done:  # awaiting the model
                conv = Conversation.from_state(renderer, ROOMY, conv.state_dict())
                assert conv.awaiting == "model"
                saved += 1
        assert saved == (0 if save_at < 0 else 1 if save_at == len(actions) - 2 else 2)
        return conv

    plain = play(-5)
    for save_at in range(len(actions) - 1):
        conv = play(save_at)
        timeless = {**conv.state_dict(), "env_seconds": plain.env_seconds}  # (wall seconds)
        assert timeless == plain.state_dict()
        assert conv.end_reason == "terminated" and conv.reward() == 1.0
        np.testing.assert_array_equal(conv.loss_mask, plain.loss_mask)
    with pytest.raises(ValueError, match="one mask entry and logprob per token"):
        Conversation.from_state(renderer, ROOMY, {**plain.state_dict(), "model": [True]})


def test_a_model_turn_over_the_budget_can_end_the_conversation():
    conv = scripted([], Limits(max_tokens=10))
    tok_ids = CharTokenizer().encode("abcdefgh")
    text = conv.add_model_turn(tok_ids, [-0.1] * 8, over_budget="end")
    assert text == "abcdefgh" and conv.end_reason == "max_tokens" and conv.turns == 1
    assert conv.ids[conv.prompt_len :] == tok_ids and conv.loss_mask.sum() == 8
    assert conv.reward() == 0.0 and conv.summary()["model_tokens"] == 8
