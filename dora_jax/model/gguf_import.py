"""A GGUF file (llama.cpp's format) -> a standard Hugging Face model directory.

:func:`convert_gguf` reads a llama-architecture GGUF with a byte-level BPE tokenizer
(``tokenizer.ggml.model = gpt2``) and writes what ``transformers`` and dora_jax load:
``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` (or shards with an index),
``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json``,
a ``README.md`` and ``conversion.json`` (the source file's sha256 and this converter's version).

The weights are de-quantised, not recovered: a quantised GGUF gives the published model after the
quantisation's round trip (SmolLM2-135M-Instruct's Q4_1 file: embeddings through Q8_0, every layer
matrix through 4 bits, norms exact), never the published float weights. The output directory's
README.md and conversion.json say so.

Two layouts differ from the file's:

- llama.cpp's converter permutes the rows of each head of the Q and K projections, so that its
  rotary embedding can rotate adjacent pairs; transformers (and dora_jax) rotate the two halves
  of each head. :func:`unpermute_rotary_rows` undoes it (the same as transformers' GGUF loader).
- GGUF stores shapes innermost first (``[in, out]``); the array a reader returns is ``[out, in]``,
  already Hugging Face's layout for a linear weight.

The tokenizer is rebuilt with the ``tokenizers`` library from the file's vocabulary, merges and
token types: control tokens become special added tokens, user-defined ones plain added tokens; the
pre-tokenizer follows ``tokenizer.ggml.pre`` (``smollm``: each digit on its own, then GPT-2's
byte-level split, as llama.cpp and SmolLM2's own ``tokenizer.json`` do; ``gpt-2``: the byte-level
split alone); other pre-tokenizers are refused rather than guessed.

Everything is checked before anything is written, and the directory is written under a temporary
name and renamed, so a refused file or a crash leaves no half directory. Imports no jax.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

CONVERTER_VERSION = 1
MARKER = "conversion.json"

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Weight types de-quantised here (by gguf-py's numpy code, as transformers' GGUF loader does).
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

OUTPUT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

PRE_TOKENIZERS = ("smollm", "gpt-2")


class GGUFImportError(ValueError):
    """A GGUF file cannot be converted: not a GGUF, an architecture, tokenizer, field, tensor or
    weight type outside what the converter supports. The message names the file and the field or
    tensor."""


# ---------------------------------------------------------------------------------------------
# reading the file


class _File:
    """A GGUF file's metadata and tensors, each read with an error naming the file and field."""

    def __init__(self, path: Path):
        import gguf

        self.path = path
        if not path.is_file():
            raise GGUFImportError(f"{path}: no such file")
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:  # gguf raises ValueError, struct.error, IndexError on bad files
            raise GGUFImportError(f"{path}: not a readable GGUF file ({e})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = ...) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFImportError(f"{self.path}: metadata field {key!r} is missing")
            return default
        try:
            return field.contents()
        except Exception as e:
            raise GGUFImportError(f"{self.path}: metadata field {key!r} unreadable ({e})") from None

    def error(self, what: str) -> GGUFImportError:
        return GGUFImportError(f"{self.path}: {what}")


def _f32(x: float) -> float:
    """A float32 field as the shortest decimal that reads back as the same float32 (the file's
    1e-5 is float32 9.9999997e-06; config.json gets 1e-05)."""
    return float(str(np.float32(x)))


# ---------------------------------------------------------------------------------------------
# config.json


def llama_config(f: _File) -> dict[str, Any]:
    """``config.json`` (without dtype) of a llama GGUF; refuses what LlamaForCausalLM lacks."""
    arch = f.get("general.architecture")
    if arch != "llama":
        raise f.error(f"general.architecture is {arch!r}; only 'llama' is supported")
    p = "llama."
    if int(f.get(p + "expert_count", 0)) > 0:
        raise f.error(
            f"{p}expert_count is {f.get(p + 'expert_count')}: mixture-of-experts "
            "llama files are not supported"
        )
    scaling = f.get(p + "rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise f.error(f"{p}rope.scaling.type is {scaling!r}; only unscaled rope is supported")
    hidden = int(f.get(p + "embedding_length"))
    heads = int(f.get(p + "attention.head_count"))
    kv_heads = int(f.get(p + "attention.head_count_kv", heads))
    head_dim = int(f.get(p + "attention.key_length", hidden // heads))
    value_dim = int(f.get(p + "attention.value_length", head_dim))
    if value_dim != head_dim:
        raise f.error(f"{p}attention.value_length {value_dim} differs from key_length {head_dim}")
    rot = int(f.get(p + "rope.dimension_count", head_dim))
    if rot != head_dim:
        raise f.error(
            f"{p}rope.dimension_count is {rot} but the head size is {head_dim}: "
            "partial rotary embeddings are not supported"
        )
    if heads % kv_heads:
        raise f.error(
            f"{p}attention.head_count {heads} is not a multiple of head_count_kv {kv_heads}"
        )
    tokens = f.get("tokenizer.ggml.tokens", None)
    vocab = int(f.get(p + "vocab_size", len(tokens) if tokens is not None else 0))
    if not vocab:
        raise f.error(f"metadata field {p + 'vocab_size'!r} and tokenizer.ggml.tokens are missing")
    theta = _f32(f.get(p + "rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(f.get(p + "feed_forward_length")),
        "num_hidden_layers": int(f.get(p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(f.get(p + "context_length", 4096)),
        "rms_norm_eps": _f32(f.get(p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "use_cache": True,
    }
    for key, name in (
        ("bos_token_id", "bos"),
        ("eos_token_id", "eos"),
        ("pad_token_id", "padding"),
    ):
        value = f.get(f"tokenizer.ggml.{name}_token_id", None)
        if value is not None:
            cfg[key] = int(value)
    return cfg


# ---------------------------------------------------------------------------------------------
# weights


def unpermute_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection ``[heads*H, D]``: within each head
    it stores rows ``(0, H/2, 1, H/2+1, ...)`` of the Hugging Face order (adjacent rotary pairs);
    this puts them back as ``(0, 1, ..., H-1)`` (rotate-half)."""
    rows = w.shape[0]
    half = rows // heads // 2
    return np.ascontiguousarray(
        w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


@dataclass(frozen=True)
class _Weight:
    gguf: str  # tensor name in the file
    hf: str  # tensor name in model.safetensors
    shape: tuple[int, ...]  # Hugging Face shape
    rotary_heads: int = 0  # > 0: undo llama.cpp's Q/K permutation with this many heads


def weight_plan(f: _File, cfg: dict[str, Any]) -> list[_Weight]:
    """Every tensor to write, in Hugging Face order, after checking that the file holds exactly
    these tensors, with these shapes and supported weight types."""
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    plan = [_Weight("token_embd.weight", "model.embed_tokens.weight", (V, D))]
    for i in range(cfg["num_hidden_layers"]):
        b, m = f"blk.{i}.", f"model.layers.{i}."
        plan += [
            _Weight(b + "attn_norm.weight", m + "input_layernorm.weight", (D,)),
            _Weight(b + "attn_q.weight", m + "self_attn.q_proj.weight", (N * H, D), N),
            _Weight(b + "attn_k.weight", m + "self_attn.k_proj.weight", (K * H, D), K),
            _Weight(b + "attn_v.weight", m + "self_attn.v_proj.weight", (K * H, D)),
            _Weight(b + "attn_output.weight", m + "self_attn.o_proj.weight", (D, N * H)),
            _Weight(b + "ffn_norm.weight", m + "post_attention_layernorm.weight", (D,)),
            _Weight(b + "ffn_gate.weight", m + "mlp.gate_proj.weight", (F, D)),
            _Weight(b + "ffn_up.weight", m + "mlp.up_proj.weight", (F, D)),
            _Weight(b + "ffn_down.weight", m + "mlp.down_proj.weight", (D, F)),
        ]
    plan.append(_Weight("output_norm.weight", "model.norm.weight", (D,)))
    if not cfg["tie_word_embeddings"]:
        plan.append(_Weight("output.weight", "lm_head.weight", (V, D)))

    for w in plan:
        t = f.tensors.get(w.gguf)
        if t is None:
            raise f.error(f"tensor {w.gguf!r} is missing (needed for {w.hf})")
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise f.error(
                f"tensor {w.gguf!r} has weight type {kind}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
        if shape != w.shape:
            raise f.error(
                f"tensor {w.gguf!r} has shape {list(shape)}, expected {list(w.shape)} "
                "from the file's metadata"
            )
    extra = sorted(set(f.tensors) - {w.gguf for w in plan})
    if extra:
        raise f.error(
            f"unexpected tensor(s) {', '.join(extra[:5])}: not part of the plain "
            "llama architecture (e.g. rope_freqs.weight: Llama-3 rope scaling; biases)"
        )
    return plan


def _dequantized(f: _File, w: _Weight) -> np.ndarray:
    from gguf.quants import dequantize

    t = f.tensors[w.gguf]
    arr = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(w.shape)
    if w.rotary_heads:
        arr = unpermute_rotary_rows(arr, w.rotary_heads)
    if not np.isfinite(arr).all():
        raise f.error(f"tensor {w.gguf!r} holds non-finite values after de-quantisation")
    return arr


def _shards(plan: list[_Weight], itemsize: int, max_bytes: int) -> list[list[_Weight]]:
    shards: list[list[_Weight]] = [[]]
    size = 0
    for w in plan:
        n = int(np.prod(w.shape)) * itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(w)
        size += n
    return shards


def _write_weights(f: _File, plan: list[_Weight], out: Path, dtype, max_bytes: int) -> None:
    """model.safetensors, or shards and an index past ``max_bytes``; one shard in memory."""
    from safetensors.numpy import save_file

    mask = os.umask(0)
    os.umask(mask)
    itemsize = np.dtype(dtype).itemsize
    shards = _shards(plan, itemsize, max_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    weight_map = {}
    for fname, shard in zip(names, shards, strict=True):
        tensors = {w.hf: _dequantized(f, w).astype(dtype) for w in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, 0o666 & ~mask)  # safetensors creates the file private
        weight_map.update({w.hf: fname for w in shard})
        del tensors
    if len(shards) > 1:
        total = sum(int(np.prod(w.shape)) * itemsize for w in plan)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# tokenizer


@dataclass(frozen=True)
class TokenizerFiles:
    tokenizer: Any  # tokenizers.Tokenizer
    config: dict[str, Any]  # tokenizer_config.json
    chat_template: str | None


def _byte_level_spelling() -> Callable[[str], str]:
    """Text -> its byte-level spelling (each UTF-8 byte as GPT-2's printable character)."""
    from tokenizers import pre_tokenizers

    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return lambda text: "".join(piece for piece, _ in spell.pre_tokenize_str(text))


def build_tokenizer(f: _File) -> TokenizerFiles:
    """The Hugging Face tokenizer of a ``gpt2`` (byte-level BPE) GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise f.error(
            f"tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) is supported"
        )
    pre = f.get("tokenizer.ggml.pre", None)
    if pre not in PRE_TOKENIZERS:
        raise f.error(
            f"tokenizer.ggml.pre is {pre!r}; supported: {', '.join(PRE_TOKENIZERS)} "
            "(another pre-tokenizer splits text differently)"
        )
    tokens = [str(t) for t in f.get("tokenizer.ggml.tokens")]
    types = [int(t) for t in f.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    if len(types) != len(tokens):
        raise f.error(
            f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    merges_text = [str(m) for m in f.get("tokenizer.ggml.merges")]

    # Byte-level vocabularies spell every token in GPT-2's 256-character byte alphabet; a token
    # outside it (rare: raw text in the file) is respelled, as transformers' GGUF loader does.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = _byte_level_spelling()
    spelled = [t if set(t) <= alphabet else spell(t) for t in tokens]
    vocab: dict[str, int] = {}
    for i, t in enumerate(spelled):
        if t in vocab:
            raise f.error(
                f"tokenizer.ggml.tokens: token {t!r} appears twice (ids {vocab[t]} and {i})"
            )
        vocab[t] = i
    merges = []
    for k, m in enumerate(merges_text):
        pair = m.split(" ")
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab:
            raise f.error(f"tokenizer.ggml.merges[{k}] = {m!r} is not two tokens of the vocabulary")
        merges.append((pair[0], pair[1]))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()

    def token_of(key: str) -> str | None:
        tid = f.get(f"tokenizer.ggml.{key}", None)
        if tid is None:
            return None
        if not 0 <= int(tid) < len(tokens):
            raise f.error(f"tokenizer.ggml.{key} {tid} is outside the vocabulary ({len(tokens)})")
        return spelled[int(tid)]

    named = {
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "pad_token": token_of("padding_token_id"),
    }
    if named["eos_token"] is None:
        raise f.error("metadata field 'tokenizer.ggml.eos_token_id' is missing")
    # Control tokens (and the named ones) are special: matched whole, skipped when decoding with
    # skip_special_tokens. User-defined ones are matched whole but decoded as text. A token only
    # stays whole under its own id when its text is its vocabulary entry, which a respelled one
    # is not: those stay ordinary vocabulary entries.
    named_ids = {vocab[t] for t in named.values() if t is not None}
    special = [
        t
        for i, t in enumerate(tokens)
        if (types[i] == CONTROL or i in named_ids) and t == spelled[i]
    ]
    user = [t for i, t in enumerate(tokens) if types[i] == USER_DEFINED and t == spelled[i]]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False))
    steps = [processors.ByteLevel(trim_offsets=False)]
    for flag, name in ((add_bos, "bos_token"), (add_eos, "eos_token")):
        if flag and named[name] is None:
            raise f.error(f"tokenizer.ggml.add_{name} is true but the file names no {name}")
    if add_bos or add_eos:
        before = [named["bos_token"]] if add_bos else []
        after = [named["eos_token"]] if add_eos else []
        single = [*before, "$A", *after]
        pair = [*single, *(f"{t}:1" for t in before), "$B:1", *(f"{t}:1" for t in after)]
        specials = sorted({(t, vocab[t]) for t in before + after})
        steps.append(
            processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
        )
    tok.post_processor = processors.Sequence(steps)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: v for k, v in named.items() if v is not None},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(f.get("llama.context_length", 4096)),
    }
    template = f.get("tokenizer.chat_template", None)
    return TokenizerFiles(tok, config, None if template is None else str(template))


# ---------------------------------------------------------------------------------------------
# the directory


def sha256_of(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_marker(directory: str | Path) -> dict[str, Any] | None:
    """The ``conversion.json`` of a converted directory, or None (absent or unreadable)."""
    try:
        return json.loads((Path(directory) / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _readme(source: Path, types: Counter, dtype: str) -> str:
    kinds = ", ".join(f"{n} x {k}" for k, n in sorted(types.items()))
    quantised = any(k not in ("F32", "F16", "BF16") for k in types)
    note = (
        "The GGUF's weights are quantised, so these are the published model's weights after "
        "that quantisation's round trip (de-quantised here), not the published float weights: "
        "expect small differences from the original model's outputs.\n"
        if quantised
        else "The GGUF's weights were stored unquantised.\n"
    )
    return (
        f"# {source.stem}\n\n"
        f"Converted from `{source.name}` by `dora_jax.model.gguf_import` (converter version "
        f"{CONVERTER_VERSION}); tensors in the file: {kinds}; written as {dtype}.\n\n"
        f"{note}\n"
        "Q and K projection rows are put back from llama.cpp's rotary layout into the Hugging "
        "Face one. The tokenizer is rebuilt from the GGUF's vocabulary, merges and token types. "
        "`conversion.json` records the source file's sha256.\n"
    )


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    overwrite: bool = False,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Convert ``gguf_path`` into the Hugging Face directory ``out_dir`` (weights in ``dtype``:
    float32, bfloat16 or float16). Checks everything first; writes under a temporary name in the
    same parent and renames. An existing ``out_dir`` is refused unless ``overwrite``."""
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(OUTPUT_DTYPES)}")
    src, out = Path(gguf_path).resolve(), Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists (overwrite=True replaces it)")
    f = _File(src)
    cfg = llama_config(f)
    plan = weight_plan(f, cfg)
    tok = build_tokenizer(f)
    n_tokens = tok.tokenizer.get_vocab_size(with_added_tokens=True)
    if n_tokens > cfg["vocab_size"]:
        raise f.error(
            f"the tokenizer has {n_tokens} tokens but the model embeds {cfg['vocab_size']}"
        )
    types = Counter(f.tensors[w.gguf].tensor_type.name for w in plan)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_dir(out, "partial")
    try:
        cfg.update(dtype=dtype, torch_dtype=dtype)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        _write_weights(f, plan, tmp, OUTPUT_DTYPES[dtype], max_shard_bytes)
        tok.tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok.config, indent=2) + "\n")
        if tok.chat_template is not None:
            (tmp / "chat_template.jinja").write_text(tok.chat_template)
        (tmp / "README.md").write_text(_readme(src, types, dtype))
        marker = {
            "converter": "dora_jax.model.gguf_import",
            "converter_version": CONVERTER_VERSION,
            "gguf_file": str(src),
            "gguf_sha256": sha256_of(src),
            "gguf_bytes": src.stat().st_size,
            "tensor_types": dict(sorted(types.items())),
            "dtype": dtype,
            "note": "weights de-quantised from the GGUF: the published model after the file's "
            "quantisation round trip",
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace(new: Path, out: Path) -> None:
    """Rename ``new`` to ``out``; an existing ``out`` is moved aside first and removed after."""
    if not out.exists():
        os.replace(new, out)
        return
    old = _fresh_dir(out, "old")
    os.replace(out, old / out.name)
    os.replace(new, out)
    shutil.rmtree(old, ignore_errors=True)


def _fresh_dir(out: Path, what: str) -> Path:
    """A new hidden directory beside ``out`` (same file system, so renames are atomic), with the
    usual permissions (``tempfile.mkdtemp`` would make it private)."""
    path = out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.{what}"
    path.mkdir()
    return path
