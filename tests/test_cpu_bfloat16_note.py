"""The note for a 16-bit model on a CPU without bfloat16 dot-product instructions."""

from dora_jax.platform import cpu_bfloat16_note


def _cpuinfo(tmp_path, flags):
    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n")
    return str(p)


def test_a_bfloat16_model_on_a_cpu_without_bf16_instructions_gets_one_line(tmp_path):
    path = _cpuinfo(tmp_path, "avx2 fma")
    note = cpu_bfloat16_note("bfloat16", "cpu", path)
    assert note.startswith("model.compute_dtype=bfloat16 on a CPU without bfloat16")
    assert path in note and "float32" in note


def test_no_note_with_the_instructions_in_float32_off_cpu_or_without_flags(tmp_path):
    assert cpu_bfloat16_note("bfloat16", "cpu", _cpuinfo(tmp_path, "avx2 avx512_bf16")) == ""
    assert cpu_bfloat16_note("bfloat16", "cpu", _cpuinfo(tmp_path, "amx_bf16 amx_tile")) == ""
    assert cpu_bfloat16_note("float32", "cpu", _cpuinfo(tmp_path, "avx2")) == ""
    assert cpu_bfloat16_note("bfloat16", "gpu", _cpuinfo(tmp_path, "avx2")) == ""
    assert cpu_bfloat16_note("bfloat16", "cpu", str(tmp_path / "missing")) == ""
