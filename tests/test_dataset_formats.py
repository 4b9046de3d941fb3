"""Datasets as users have them: the same 20 prompts from JSONL (plain strings, the system prompt
from the config), Parquet in veRL's layout (chat messages, ``reward_model.ground_truth``) and a
Hugging Face dataset (``save_to_disk``; ``load_dataset`` on the Parquet file) give identical
token ids through a chat template; shuffling over epochs resumes exactly; bad rows are named."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_tokenizer_files import write_word_tokenizer  # tests/hf_tokenizer_files.py

from dora_jax.config import load_config
from dora_jax.data import DataError, PromptSource
from dora_jax.data.prompts import shuffled_epochs
from dora_jax.model.tokenizer import HFTokenizer
from dora_jax.pipeline.experiment import load_examples
from dora_jax.pipeline.grpo import TokenizedPrompts

SYSTEM = "you are a careful solver"
WORDS = [
    "you",
    "are",
    "a",
    "careful",
    "solver",
    "what",
    "is",
    "plus",
    "?",
    "system",
    "user",
    "assistant",
    "answer",
    "briefly",
    ".",
] + [str(i) for i in range(40)]
N = 20


def _question(i: int) -> str:
    return f"what is {i} plus {i + 1} ?"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    tok = HFTokenizer(write_word_tokenizer(d, WORDS))
    plain = [{"prompt": _question(i), "answer": str(2 * i + 1), "level": i % 3} for i in range(N)]
    (d / "plain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain))
    verl = [
        {
            "data_source": "toy",
            "prompt": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": _question(i)},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(N)
    ]
    pq.write_table(pa.Table.from_pylist(verl), d / "verl.parquet")
    datasets.Dataset.from_list(verl).save_to_disk(str(d / "verl_hf"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(verl)}).save_to_disk(
        str(d / "verl_dict")
    )
    return d, tok


def _ids(tok, task, path, *over):
    cfg = load_config(
        None,
        [
            f"data.task={task}",
            f"data.path={path}",
            "data.shuffle=false",
            "rollout.max_prompt_len=64",
            *over,
        ],
    )
    examples = load_examples(cfg, str(path))
    d = cfg.data
    prompts = TokenizedPrompts(
        PromptSource(shuffled_epochs(examples, 0, False), "t"),
        tok,
        64,
        d.system_prompt,
        d.prompt_template,
    )
    specs = [prompts.next_prompt() for _ in range(N)]
    return [s.payload.tokens for s in specs], [s.payload.answer for s in specs], specs


def test_jsonl_parquet_and_hf_datasets_give_identical_token_ids(files):
    d, tok = files
    verl = ["data.answer_field=reward_model.ground_truth"]
    ids, answers, specs = _ids(tok, "jsonl", d / "plain.jsonl", f"data.system_prompt={SYSTEM}")
    assert len(ids) == N and all(3 < len(t) < 64 for t in ids)
    assert 0 not in {t for s in ids for t in s}  # no <unk>: every word is in the vocabulary
    for task, path, extra in [
        ("parquet", d / "verl.parquet", []),
        ("hf", d / "verl_hf", []),
        ("hf", d / "verl_dict", ["data.split=test"]),
        ("hf", d / "verl.parquet", []),  # load_dataset("parquet", data_files=...)
    ]:
        got, got_answers, got_specs = _ids(tok, task, path, *verl, *extra)
        assert got == ids, (task, path)
        assert got_answers == answers == [str(2 * i + 1) for i in range(N)]
        meta = got_specs[3].payload.metadata  # the row's other fields, for reward functions
        assert meta["extra_info"] == {"index": 3, "split": "train"}
        assert meta["reward_model"]["ground_truth"] == "7" and meta["data_source"] == "toy"
    assert specs[5].payload.metadata == {"answer": "11", "level": 2}
    # the rendered text went through the chat template, the system message first
    text = tok.decode(ids[0], skip_special=False)
    assert text.split()[:3] == ["<|im_start|>", "system", "you"], text
    assert text.split()[-2:] == ["<|im_start|>", "assistant"], text


def test_prompt_template_wraps_string_prompts(files):
    d, tok = files
    ids, _, _ = _ids(
        tok, "jsonl", d / "plain.jsonl", "data.prompt_template={prompt} answer briefly ."
    )
    text = tok.decode(ids[1], skip_special=True)
    assert "1 plus 2 ? answer briefly ." in text


def test_shuffled_epochs_resume_exactly():
    items = [(str(i), "answer") for i in range(7)]
    a = PromptSource(shuffled_epochs(items, seed=3), "x")
    first = [(p.text, p.answer) for p in a.take(10)]  # into the second epoch
    state = a.state()
    rest = [(p.text, p.answer) for p in a.take(12)]
    b = PromptSource(shuffled_epochs(items, seed=3), "x")
    b.restore(state)
    assert [(p.text, p.answer) for p in b.take(12)] == rest
    assert sorted(first[:7]) == items and first[:7] != items  # shuffled, each once per epoch
    c = PromptSource(shuffled_epochs(items, seed=3, shuffle=False), "x")
    assert [(p.text, p.answer) for p in c.take(9)] == items + items[:2]


def test_bad_rows_name_the_file_row_and_field(files, tmp_path):
    d, _ = files
    cfg = load_config(
        None,
        [
            "data.task=parquet",
            f"data.path={d / 'verl.parquet'}",
            "data.answer_field=reward_model.truth",
        ],
    )
    with pytest.raises(
        DataError,
        match=r"verl\.parquet:1: missing field 'reward_model\.truth' "
        r"\(reward_model has: \['ground_truth', 'style'\]\)",
    ):
        load_examples(cfg, cfg.data.path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"prompt": "a", "answer": "1"}\n{"prompt": [{"role": "robot", '
        '"content": "x"}], "answer": "2"}\n'
    )
    cfg = load_config(None, ["data.task=jsonl", f"data.path={bad}"])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'prompt'\[0\]: role must be"):
        load_examples(cfg, str(bad))
    cfg = load_config(None, ["data.task=hf", f"data.path={d / 'verl_dict'}"])
    with pytest.raises(DataError, match=r"no split 'train' \(has: \['test'\]; data.split\)"):
        load_examples(cfg, cfg.data.path)
    cfg = load_config(None, ["data.task=parquet", f"data.path={bad}"])
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_examples(cfg, str(bad))
