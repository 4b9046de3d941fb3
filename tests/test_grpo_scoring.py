"""GRPOTrainer's scoring with the Scorer: a request prefetched as it finished (the real backend's
``on_finished``) and then consumed by a train step has its undecodable ids counted once, and the
reward function reads the response without them and without any EOS id."""

from types import SimpleNamespace

from dora_jax.data.scoring import Scorer
from dora_jax.execution.payloads import Completion, PromptPayload
from dora_jax.model.tokenizer import CharTokenizer
from dora_jax.orchestrator.backend import FinishedRequest
from dora_jax.orchestrator.transfer_queue import ReadyGroup
from dora_jax.pipeline.grpo import GRPOTrainer


class PaddedVocabTokenizer(CharTokenizer):
    """Decodes ids past its vocabulary to nothing, as ``tokenizers`` does (CharTokenizer raises)."""

    def decode(self, ids, skip_special=True):
        return super().decode([t for t in ids if t < self.vocab_size], skip_special)


class StubTrainer:
    """Only what GRPOTrainer asks of a Trainer (no arrays, no jit)."""

    def __init__(self):
        self.state = SimpleNamespace(version=0, skipped=0)

    @property
    def version(self):
        return self.state.version

    def export_params(self, shardings=None):
        return {"v": self.state.version}

    def pack(self, trajectories, num_groups, **kw):
        return trajectories

    def step(self, packed):
        self.state.version += 1
        return {"loss": 0.0}


def test_prefetched_request_counts_undecodable_ids_once():
    tok = PaddedVocabTokenizer()
    seen = []

    def reward(response: str, answer: str) -> float:
        seen.append(response)
        return float(response == answer)

    grpo = GRPOTrainer(StubTrainer(), tok, Scorer(reward))
    prompt = PromptPayload(0, tuple(tok.encode("1+1=")), "2")
    past = tok.vocab_size + 5  # an id of a larger, padded model vocabulary
    tokens = (*tok.encode("2"), past, past + 1, tok.eos_id)
    comp = Completion(prompt, tokens, (0.0,) * len(tokens), "eos", len(prompt.tokens), 0)
    finished = FinishedRequest(7, 0, len(prompt.tokens), len(tokens), (0,), comp)
    grpo.prefetch(7, comp)  # as the backend does when the request finishes
    assert grpo.undecodable_tokens == 0  # counted when consumed, not when prefetched
    grpo.step([ReadyGroup(0, 0, (finished,), 0)])
    assert grpo.undecodable_tokens == 2
    assert grpo.log[-1].metrics["undecodable_tokens"] == 2
    assert seen == ["2"] and grpo.log[-1].rewards == [1.0]
