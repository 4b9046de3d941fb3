"""``data.on_failure`` end to end through :meth:`GRPOTrainer.step`: a reward function that raises
for one particular response (and an environment call that failed) scores 0 and is counted, and
the advantages the train step computes from the packed batch are the ones the policy says
(``zero``: today's; ``drop_sample``: the others' from the others' rewards only, the failed one 0;
``drop_group``: the whole group 0), for GRPO, Dr. GRPO and RLOO, against a NumPy oracle. The
train step itself (no loss weight on a dropped sample) is tested in ``test_train_step.py``, the
advantage math in ``test_train_math.py``."""

from types import SimpleNamespace

import numpy as np
import pytest
from reliability_cases import expect  # tests/reliability_cases.py

from dora_jax.config import ConfigError, DataConfig, TrainConfig
from dora_jax.data.scoring import Scorer
from dora_jax.execution.payloads import Completion, PromptPayload
from dora_jax.model.tokenizer import CharTokenizer
from dora_jax.orchestrator.backend import FinishedRequest
from dora_jax.orchestrator.transfer_queue import ReadyGroup
from dora_jax.pipeline.grpo import GRPOTrainer
from dora_jax.pipeline.run_report import failure_totals
from dora_jax.train import pack_batch
from dora_jax.train.step import batch_advantages

TOK = CharTokenizer()
G = 4
# the responses of two prompt groups; the reward function raises for "9" (group 0, member 2)
RESPONSES = (("3", "0", "9", "2"), ("1", "3", "0", "2"))
BROKEN = "9"


def reward(response: str, answer: str) -> float:
    if response == BROKEN:
        raise RuntimeError("the verifier broke on this one")
    return int(response) / 4


class AdvantageTrainer:
    """A Trainer that packs for real (:func:`pack_batch`) and computes the advantages its step
    would (:func:`batch_advantages`, what ``train_step`` uses), without a model."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.state = SimpleNamespace(version=0, skipped=0)
        self.advantages: list[np.ndarray] = []
        self.rewards: list[np.ndarray] = []

    def export_params(self, shardings=None):
        return {"v": self.state.version}

    def pack(self, trajectories, num_groups, version, **kw):
        return pack_batch(trajectories, self.cfg, trainer_version=version, num_groups=num_groups)

    def step(self, batch):
        self.rewards.append(np.asarray(batch.rewards))
        self.advantages.append(np.asarray(batch_advantages(batch, self.cfg)))
        self.state.version += 1
        return {"loss": 0.0}


def completion(index: int, response: str, conversation: dict | None = None) -> Completion:
    prompt = PromptPayload(index, tuple(TOK.encode(f"{index}+0=")), str(index))
    tokens = (*TOK.encode(response), TOK.eos_id)
    env_reward = None if conversation is None else 0.0
    logprobs = (-0.5,) * len(tokens)
    return Completion(
        prompt,
        tokens,
        logprobs,
        "eos",
        len(prompt.tokens),
        0,
        env_reward=env_reward,
        conversation=conversation,
    )


def ready_groups(
    responses=RESPONSES, failed_env: tuple[int, int] | None = None
) -> list[ReadyGroup]:
    """Prompt group ``g``'s member ``i`` is request ``10 * g + i``; ``failed_env``: the member
    whose conversation a timed-out environment call ended (reward 0 from the environment)."""
    groups = []
    for g, texts in enumerate(responses):
        members = []
        for i, text in enumerate(texts):
            conv = None
            if failed_env == (g, i):
                conv = {"turns": 1, "end_reason": "env_timeout", "error": "timeout"}
            comp = completion(g, text, conv)
            n, p = len(comp.tokens), len(comp.prompt.tokens)
            members.append(FinishedRequest(10 * g + i, g, p, n, (0,), comp))
        groups.append(ReadyGroup(g, 0, tuple(members), 0))
    return groups


def oracle(rewards, failed, policy, mode, normalize_std, eps):
    """Per group: the members kept (all; those that did not fail; none if one failed), mean and
    population std over them, or the leave-one-out mean of the other kept ones; 0 elsewhere."""
    out = np.zeros(rewards.shape)
    for g in range(rewards.shape[0]):
        r, f = rewards[g].astype(np.float64), failed[g]
        keep = [i for i in range(G) if policy == "zero" or not f[i]]
        if policy == "drop_group" and f.any():
            keep = []
        if len(keep) < 2:
            continue
        for i in keep:
            if mode == "rloo":
                out[g, i] = r[i] - np.mean([r[j] for j in keep if j != i])
            else:
                mean = np.mean(r[keep])
                std = np.sqrt(np.mean((r[keep] - mean) ** 2))
                out[g, i] = (r[i] - mean) / (std + eps) if normalize_std else r[i] - mean
    return out


@pytest.mark.parametrize("mode,normalize_std", [("grpo", True), ("grpo", False), ("rloo", False)])
@pytest.mark.parametrize("policy", ["zero", "drop_sample", "drop_group"])
def test_a_reward_function_raising_for_one_response_gets_the_policys_advantages(
    policy, mode, normalize_std, caplog
):
    cfg = TrainConfig(
        group_size=G, length_buckets=(16, 32), advantage=mode, normalize_std=normalize_std
    )
    trainer = AdvantageTrainer(cfg)
    scorer = Scorer(reward)
    grpo = GRPOTrainer(trainer, TOK, scorer, on_failure=policy)
    grpo.step(ready_groups())

    # the failed call scored 0, was counted by kind, and its trajectory was consumed
    assert scorer.error_counts()["exception"] == 1
    expect("reward-raises-one-response", caplog.text)
    log = grpo.log[-1]
    assert log.trajectories == [0, 1, 2, 3, 10, 11, 12, 13]
    assert log.rewards == [0.75, 0.0, 0.0, 0.5, 0.25, 0.75, 0.0, 0.5]
    rewards = trainer.rewards[-1].reshape(2, G)
    failed = np.zeros((2, G), bool)
    failed[0, 2] = True
    want = oracle(rewards, failed, policy, mode, normalize_std, cfg.adv_eps)
    got = trainer.advantages[-1].reshape(2, G)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if policy == "drop_sample":  # the others' baseline is theirs: mean of 0.75, 0, 0.5
        assert got[0, 2] == 0.0
        np.testing.assert_allclose(got[0, [0, 1, 3]].sum(), 0.0, atol=1e-6)
        assert got[0, 1] < 0 < got[0, 3] < got[0, 0]
    if policy == "drop_group":
        assert np.all(got[0] == 0.0)
    # the clean group is the same under every policy
    clean = oracle(rewards, np.zeros((2, G), bool), "zero", mode, normalize_std, cfg.adv_eps)
    np.testing.assert_allclose(got[1], clean[1], rtol=1e-5, atol=1e-6)
    dropped = {"zero": (0, 0), "drop_sample": (1, 0), "drop_group": (4, 1)}[policy]
    m = log.metrics
    assert (m["failed_samples"], m["failed_samples_dropped"], m["failed_groups_dropped"]) == (
        1,
        *dropped,
    )


@pytest.mark.parametrize("policy", ["zero", "drop_sample", "drop_group"])
def test_a_failed_environment_call_is_a_failure_too(policy):
    """A conversation that a timed-out environment call ended (reward 0 from the environment)."""
    cfg = TrainConfig(group_size=G, length_buckets=(16, 32))
    trainer = AdvantageTrainer(cfg)
    grpo = GRPOTrainer(trainer, TOK, Scorer(lambda r, a: int(r) / 4), on_failure=policy)
    grpo.step(ready_groups((("1", "0", "3", "2"), ("1", "3", "0", "2")), failed_env=(1, 3)))
    rewards = trainer.rewards[-1].reshape(2, G)
    assert rewards[1, 3] == 0.0  # the environment's reward after a failed call
    failed = np.zeros((2, G), bool)
    failed[1, 3] = True
    want = oracle(rewards, failed, policy, "grpo", True, cfg.adv_eps)
    np.testing.assert_allclose(trainer.advantages[-1].reshape(2, G), want, rtol=1e-5, atol=1e-6)
    assert grpo.log[-1].metrics["failed_samples"] == 1


def test_a_group_whose_every_member_failed_gives_no_gradient():
    trainer = AdvantageTrainer(TrainConfig(group_size=G, length_buckets=(16, 32)))

    def broken(response: str, answer: str) -> float:
        raise ValueError("down")

    grpo = GRPOTrainer(trainer, TOK, Scorer(broken))  # the default policy: drop_sample
    grpo.step(ready_groups())
    assert np.all(trainer.advantages[-1] == 0.0)
    m = grpo.log[-1].metrics
    assert (m["failed_samples"], m["failed_samples_dropped"], m["failed_groups_dropped"]) == (
        8,
        8,
        2,
    )
    assert len(grpo.log[-1].trajectories) == 8  # consumed, never silently lost


def test_the_summary_sums_the_steps():
    rows = [
        {"failed_samples": 2, "failed_samples_dropped": 2, "failed_groups_dropped": 1},
        {"failed_samples": 1, "failed_samples_dropped": 1, "failed_groups_dropped": 0},
        {},  # a step logged before the figures existed
    ]
    assert failure_totals(rows) == {
        "failed_samples": 3,
        "failed_samples_dropped": 3,
        "failed_groups_dropped": 1,
    }


def test_the_policy_is_validated_naming_the_field():
    assert DataConfig().on_failure == "drop_sample"
    with pytest.raises(ConfigError, match="on_failure") as e:
        DataConfig(on_failure="skip")
    assert e.value.path.endswith("on_failure")
    with pytest.raises(ValueError, match="on_failure"):
        GRPOTrainer(AdvantageTrainer(TrainConfig(group_size=G)), TOK, reward, on_failure="drop")
