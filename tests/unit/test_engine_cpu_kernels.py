"""The CPU paged-attention kernel against torch's gather + SDPA on the same scattered cache."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from cloud.engine import cpu_kernels
from cloud.engine.attention import AttentionMetadata, build_group, paged_attention
from cloud.engine.cpu_kernels import decode_step_function, paged_attention_kernel


@pytest.fixture
def kernel() -> cpu_kernels.PagedAttention:
    k = paged_attention_kernel()
    assert k is not None, "the CPU paged-attention kernel did not build (see the log)"
    return k


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("q_len", [1, 3, 5])
def test_the_kernel_attends_like_torch_over_scattered_blocks(
    kernel: cpu_kernels.PagedAttention, num_heads: int, num_kv_heads: int, q_len: int
) -> None:
    rng, gen = random.Random(q_len * 31 + num_heads), torch.Generator().manual_seed(q_len)
    num_blocks, block_size, head_dim = 96, 8, 32
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    contexts = [q_len, q_len + 1, 8, 9, 40, 77, rng.randint(q_len, 120)]  # a context of exactly q_len included
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in contexts]
    q = torch.randn(len(contexts) * q_len, num_heads, head_dim, generator=gen)
    k = torch.randn(len(contexts) * q_len, num_kv_heads, head_dim, generator=gen)  # the new tokens' keys
    v = torch.randn(len(contexts) * q_len, num_kv_heads, head_dim, generator=gen)
    bs = block_size
    slots = torch.tensor(
        [tables[s][p // bs] * bs + p % bs for s, c in enumerate(contexts) for p in range(c - q_len, c)]
    )
    cpu = torch.device("cpu")
    torch_group = build_group(0, q_len, contexts, tables, block_size, cpu)
    kernel_group = build_group(0, q_len, contexts, tables, block_size, cpu, for_kernel=True)
    assert kernel_group.mask is None and kernel_group.context_lens is not None
    expected = paged_attention(q, k, v, k_cache, v_cache, AttentionMetadata(slots, [torch_group]), 0.17)
    got = paged_attention(q, k, v, k_cache, v_cache, AttentionMetadata(slots, [kernel_group], kernel), 0.17)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_without_a_compiler_or_when_switched_off_the_engine_keeps_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("TIERLINE_CPU_KERNELS", "0")
    assert paged_attention_kernel() is None
    monkeypatch.delenv("TIERLINE_CPU_KERNELS")
    monkeypatch.setenv("TIERLINE_KERNEL_CACHE", str(tmp_path / "kernels"))
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: no such compiler' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with caplog.at_level(logging.WARNING, logger="cloud.engine.cpu_kernels"):
        assert paged_attention_kernel() is None
    assert "gathering blocks with torch" in caplog.text and "no such compiler" in caplog.text


def test_the_fused_decode_step_follows_the_same_switch_and_fallback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "_loaded_decode", {})
    monkeypatch.setenv("TIERLINE_CPU_KERNELS", "off")
    assert decode_step_function() is None
    monkeypatch.delenv("TIERLINE_CPU_KERNELS")
    monkeypatch.setenv("TIERLINE_KERNEL_CACHE", str(tmp_path / "kernels"))
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: no such compiler' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with caplog.at_level(logging.WARNING, logger="cloud.engine.cpu_kernels"):
        assert decode_step_function() is None
    assert "small decode steps run the torch model" in caplog.text and "no such compiler" in caplog.text


def test_the_build_is_cached_on_disk_and_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_loaded_decode", {})
    monkeypatch.setenv("TIERLINE_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert paged_attention_kernel() is not None and decode_step_function() is not None
    assert len(list((tmp_path / "kernels").glob("decode_step-*.so"))) == 1
    built = list((tmp_path / "kernels").glob("paged_attention-*.so"))
    assert len(built) == 1 and (tmp_path / "kernels").stat().st_mode & 0o077 == 0
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert paged_attention_kernel() is not None  # a new process: the cached library, not a rebuild
    assert built[0].stat().st_mtime_ns == stamp


def test_code_is_never_loaded_from_a_cache_folder_others_can_write(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TIERLINE_KERNEL_CACHE", str(shared))
    with caplog.at_level(logging.WARNING, logger="cloud.engine.cpu_kernels"):
        assert paged_attention_kernel() is None
    assert "not private" in caplog.text and not list(shared.iterdir())


def test_a_packed_matrix_is_in_panels_and_a_full_panel_in_sub_panels() -> None:
    from cloud.engine.fused_decoder import pack_panels

    w = torch.arange(3 * 70, dtype=torch.float32).reshape(3, 70)  # [n_in, n_out]: value = i * 70 + j
    # Panels of 32 columns in sub-panels of 16, each [3, 16] row-major; the last panel (columns 64..69) whole.
    packed = pack_panels(w, 32, 16)
    expected = [w[:, s : s + 16].reshape(-1) for s in (0, 16, 32, 48)] + [w[:, 64:].reshape(-1)]
    assert torch.equal(packed, torch.cat(expected))
    assert packed[48:52].tolist() == [16.0, 17.0, 18.0, 19.0]  # panel 0's second sub-panel, after 3 rows of 16
    # Whole panels by default.
    assert torch.equal(pack_panels(w, 32), torch.cat([w[:, j : j + 32].reshape(-1) for j in (0, 32, 64)]))
    with pytest.raises(ValueError, match="multiple"):
        pack_panels(w, 32, 12)


def test_the_kernel_names_its_panels_and_sub_panels() -> None:
    if decode_step_function() is None:
        pytest.skip("the fused decode step is not built here (no C compiler)")
    width = cpu_kernels.panel_width()
    for int8 in (False, True):
        sub = cpu_kernels.sub_panel_width(int8)
        assert width > 0 and 0 < sub <= width and width % sub == 0, (width, sub)
    # A full panel is in sub-panels of one cache line a row where its rows are wider, on AVX2 and AVX-512 builds.
    if " avx" in cpu_kernels._cpu_flags():
        assert (cpu_kernels.sub_panel_width(False), cpu_kernels.sub_panel_width(True)) == (16, min(width, 64))


def test_intel_hosts_build_the_tiles_to_prefetch_into_every_cache_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-temporal prefetches of the weights made verification tiles 3-4x slower on a Xeon (docs/engine.md)."""
    monkeypatch.setattr(cpu_kernels, "_cpu_vendor", lambda: "GenuineIntel")
    assert cpu_kernels._host_defines() == ("-DTILE_PREFETCH_LOCALITY=3",)
    monkeypatch.setattr(cpu_kernels, "_cpu_vendor", lambda: "AuthenticAMD")
    assert cpu_kernels._host_defines() == ()


@pytest.mark.parametrize("march", ["x86-64", "sandybridge", "haswell", "skylake-avx512"])
def test_the_kernels_build_for_every_x86_vector_width(march: str, tmp_path: Path) -> None:
    """A host compiles for itself (-march=native): SSE2 only, AVX without AVX2 or FMA, AVX2 with FMA, AVX-512 take
    different branches of the same source; each must build (an AVX-only host once failed on an intrinsic it lacked,
    and served every step through torch)."""
    import platform
    import shutil
    import subprocess

    compiler = shutil.which("gcc")
    if compiler is None or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("needs gcc on an x86-64 host")
    flags = [f"-march={march}" if f == "-march=native" else f for f in cpu_kernels.FLAGS]
    flags += ["-DTILE_PREFETCH_LOCALITY=3"] if march in ("haswell", "skylake-avx512") else []  # (Intel's choice)
    for name, source in (("attention", cpu_kernels.SOURCE), ("decode_step", cpu_kernels.DECODE_SOURCE)):
        src = tmp_path / f"{name}.c"
        src.write_text(source)
        built = subprocess.run(
            [compiler, *flags, "-o", str(tmp_path / f"{name}.so"), str(src), "-lm"], capture_output=True, text=True
        )
        assert built.returncode == 0, f"{name} for {march}: {built.stderr[-2000:]}"
