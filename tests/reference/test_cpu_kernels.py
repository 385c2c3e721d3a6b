"""The reference engine's CPU kernels (reference/kernels/cpu_kernels.c), the bf16 linear and
RMSNorm: each built kernel gives the bits its PyTorch specification gives, and a row's output
does not depend on how many rows are computed with it (decode, verify and a batch agree bit for
bit); the verify's GDN chunk computes the delta rule and is the same for a sequence alone. The
libraries are built at install time (kernels/build.py, run by setup.py), one per instruction
set; without one the PyTorch ops run, and say so once."""
import shlex

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.reference.kernels import build as kernel_build
from speccheck.reference.kernels import cpu as cpu_kernels
from speccheck.reference.kernels.cpu import (rms_norm, rms_norm_torch, rowinv_linear,
                                             rowinv_linear_torch)

pytestmark = [pytest.mark.skipif(kernel_build.compiler() is None, reason="no C compiler here"),
              pytest.mark.usefixtures("built")]


@pytest.fixture(scope="module")
def built():
    """With a C compiler here, the install's libraries must be there and loaded (a checkout:
    ``pip install -e .``, or ``python -m speccheck.reference.kernels.build``)."""
    assert cpu_kernels.loaded() == cpu_kernels.isa(), \
        f"no built CPU kernel library for {cpu_kernels.isa()} in {cpu_kernels._LIB_DIR}"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 30), n=st.integers(1, 70), k=st.integers(1, 300), seed=st.integers(0, 2**16),
       fp32=st.booleans())
def test_kernel_equals_its_specification_and_each_row_alone(m, n, k, seed, fp32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    dtype = torch.float32 if fp32 else torch.bfloat16
    got = rowinv_linear(x, w, dtype)
    assert torch.equal(bits(got), bits(rowinv_linear_torch(x, w, dtype)))
    for i in range(m):
        assert torch.equal(bits(rowinv_linear(x[i:i + 1], w, dtype)[0]), bits(got[i]))
    exact = x.double() @ w.double().T
    assert torch.allclose(got.double(), exact, rtol=1e-2 if not fp32 else 1e-5, atol=1e-5)


def test_a_prefill_sized_product_takes_the_wide_path_with_the_same_bits():
    """Past 96 rows (two row blocks of the wide path) and a K that is no multiple of 16."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 72, generator=g).bfloat16()
    w = (torch.randn(40, 72, generator=g) * 0.1).bfloat16()
    got = rowinv_linear(x, w)
    assert torch.equal(bits(got), bits(rowinv_linear_torch(x, w)))
    assert torch.equal(bits(rowinv_linear(x[150:151], w)[0]), bits(got[150]))


def test_leading_dims_and_non_contiguous_inputs():
    x = torch.randn(2, 3, 40).bfloat16()
    w = torch.randn(24, 40).bfloat16()
    got = rowinv_linear(x.transpose(0, 1), w)
    assert got.shape == (3, 2, 24)
    assert torch.equal(bits(got), bits(rowinv_linear_torch(x.transpose(0, 1).contiguous(), w)))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 12), d=st.integers(1, 300), seed=st.integers(0, 2**16),
       x_bf16=st.booleans(), fp32=st.booleans(), scaled=st.booleans())
def test_rms_norm_equals_its_specification_and_each_row_alone(m, d, seed, x_bf16, fp32, scaled):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g) * 3
    x = x.bfloat16() if x_bf16 else x
    scale = 1 + 0.1 * torch.randn(d, generator=g) if scaled else None
    dtype = torch.float32 if fp32 else torch.bfloat16
    got = rms_norm(x, scale, 1e-6, dtype)
    assert torch.equal(bits(got), bits(rms_norm_torch(x, scale, 1e-6, dtype)))
    for i in range(m):
        assert torch.equal(bits(rms_norm(x[i:i + 1], scale, 1e-6, dtype)[0]), bits(got[i]))
    want = torch.nn.functional.rms_norm(x.double(), (d,), None if scale is None else scale.double(),
                                        1e-6)
    assert torch.allclose(got.double(), want, rtol=1e-2 if not fp32 else 1e-5, atol=1e-5)


def _gdn_reference(qkv, g, beta, s0, H, D):
    """The gated delta rule one position at a time in float64 (the recurrent form): outputs
    [B, T, H, D] and the state after each position."""
    B, T, _ = qkv.shape
    q, k, v = (t.double().reshape(B, T, H, D) for t in qkv.split([H * D] * 3, -1))
    q = q / (q * q).sum(-1, keepdim=True).add(1e-6).sqrt() * D ** -0.5
    k = k / (k * k).sum(-1, keepdim=True).add(1e-6).sqrt()
    S, outs, states = s0.double(), [], []
    for t in range(T):
        S = S * g[:, t].double().exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhd,bhde->bhe", k[:, t], S)) * beta[:, t].double()[..., None]
        S = S + torch.einsum("bhd,bhe->bhde", k[:, t], delta)
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, t], S))
        states.append(S)
    return torch.stack(outs, 1), states


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 16), h=st.integers(1, 4), d=st.sampled_from([8, 16, 64]),
       seed=st.integers(0, 2**16))
def test_gdn_chunk_is_the_delta_rule_and_each_sequence_alone(b, t, h, d, seed):
    """The verify's C chunk (cpu_kernels.gdn_chunk): outputs and the state after any position
    equal the rule computed one position at a time in float64 (to fp32 rounding), and a
    sequence gets the same bits alone as in a batch."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, t, 3 * h * d, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 2
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, d, d, generator=gen) * 0.3
    out, parts = cpu_kernels.gdn_chunk(qkv, g, beta, s0, h, d, d)
    want, states = _gdn_reference(qkv, g, beta, s0, h, d)
    assert torch.allclose(out.double(), want, rtol=1e-4, atol=1e-5)
    idx = torch.randint(0, t, (b,), generator=gen)
    got = cpu_kernels.gdn_chunk_state(parts, idx)
    for i in range(b):
        assert torch.allclose(got[i].double(), states[int(idx[i])][i], rtol=1e-4, atol=1e-5)
        alone, p1 = cpu_kernels.gdn_chunk(qkv[i:i + 1], g[i:i + 1], beta[i:i + 1], s0[i:i + 1], h, d, d)
        assert torch.equal(bits(alone[0]), bits(out[i]))
        assert torch.equal(bits(cpu_kernels.gdn_chunk_state(p1, idx[i:i + 1])[0]), bits(got[i]))


def test_a_cpu_verify_runs_the_gdn_chunk_kernel_close_to_the_pytorch_form(monkeypatch):
    """The reference target's verify forward takes the C chunk for every GDN layer, and its
    logits stay within fp32-level noise of the same form as PyTorch ops."""
    from speccheck.reference import model
    from speccheck.reference.engine import ReferenceEngine

    eng = ReferenceEngine(engine_args={"dtype": "fp32"})
    d = eng.decoder
    with torch.inference_mode():
        cache, *_ = d._prefill([[10 + i for i in range(40)]], 64, 5, ())
        snap = cache.snapshot()
        feed = d._t([5, 6, 7, 8, 9, 10])[None]

        def verify():
            cache.restore(snap)
            h, _ = d.target(feed, cache, gdn_form="chunked", per_position=True)
            kinds = {i: p[1].kernel is not None for i, p in cache.pending.items()}
            cache.commit(4)
            return d.target.logits(h[0]), kinds, [s.clone() for s in cache.gdn if s is not None]

        c_logits, c_kinds, c_states = verify()
        monkeypatch.setattr(model, "compiled", lambda: False)
        t_logits, t_kinds, t_states = verify()
    assert all(c_kinds.values()) and len(c_kinds) == 6 and not any(t_kinds.values())
    assert torch.allclose(c_logits, t_logits, rtol=1e-4, atol=1e-4)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(c_states, t_states))


_ISA_PRODUCTS = """
import sys, torch
from pathlib import Path
from speccheck.reference.kernels import cpu as ck
if sys.argv[2] != "-":
    ck._LIB_DIR = Path(sys.argv[2])
g = torch.Generator().manual_seed(7)
outs = {"isa": ck.loaded()}
for m, n, k in [(1, 70, 256), (3, 9, 40), (5, 33, 72), (6, 1032, 256), (7, 20, 300), (100, 24, 512)]:
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    outs[(m, n, k)] = (ck.rowinv_linear(x, w), ck.rowinv_linear(x, w, torch.float32))
x = torch.randn(9, 200, generator=g)
outs["norm"] = ck.rms_norm(x, 1 + 0.1 * torch.randn(200, generator=g), 1e-6, torch.float32)
qkv, s0 = torch.randn(2, 6, 3 * 2 * 16, generator=g), torch.randn(2, 2, 16, 16, generator=g)
gate, beta = -torch.rand(2, 6, 2, generator=g), torch.rand(2, 6, 2, generator=g)
outs["gdn"] = ck.gdn_chunk(qkv, gate, beta, s0, 2, 16, 16)[0]
torch.save(outs, sys.argv[1])
"""


@pytest.mark.slow
def test_every_instruction_set_this_cpu_has_gives_the_same_bits(tmp_path, monkeypatch):
    """The kernels built for each vector instruction set this CPU can run (AVX-512 tiles, AVX2,
    generic C; ``SPECCHECK_CPU_ISA``), by the install's own build step, give the same bits for
    decode-, verify- and prefill-sized products, RMSNorm and the GDN chunk, and so does the
    library the install built: a golden recorded on one CPU holds on another."""
    import os
    import subprocess
    import sys

    monkeypatch.delenv("SPECCHECK_CPU_ISA", raising=False)
    monkeypatch.delenv("SPECCHECK_CPU_LINEAR", raising=False)
    fits = cpu_kernels._fitting()
    assert fits[-1] == "generic"
    assert sorted(kernel_build.build_all(tmp_path / "lib", fits)) == sorted(fits)
    runs = [(name, str(tmp_path / "lib"), {"SPECCHECK_CPU_ISA": name}) for name in fits]
    runs.append(("installed", "-", {}))
    results = {}
    for label, lib_dir, env in runs:
        path = tmp_path / f"{label}.pt"
        subprocess.run([sys.executable, "-c", _ISA_PRODUCTS, str(path), lib_dir], check=True,
                       env={**os.environ, **env})
        results[label] = torch.load(path)
        assert results[label].pop("isa") == (fits[0] if label == "installed" else label)
    first = results[fits[0]]
    for label in [*fits[1:], "installed"]:
        for key, got in results[label].items():
            got, want = (got, first[key]) if isinstance(got, tuple) else ((got,), (first[key],))
            for a, b in zip(got, want):
                assert torch.equal(bits(a), bits(b)), (label, key)


def test_an_instruction_set_the_cpu_lacks_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"sse2"})
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("SPECCHECK_CPU_ISA", "avx2")
    with pytest.raises(ValueError, match="lacks.*avx2.*it can run.*generic"):
        cpu_kernels.isa()
    monkeypatch.setenv("SPECCHECK_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="choose one of"):
        cpu_kernels.isa()
    monkeypatch.delenv("SPECCHECK_CPU_ISA")
    assert cpu_kernels.isa() == "generic"


def _fresh(monkeypatch, lib_dir, fits=None):
    """cpu.py as at first use, looking for its libraries in ``lib_dir`` (monkeypatch puts the
    loaded library back afterwards)."""
    monkeypatch.setattr(cpu_kernels, "_LIB_DIR", lib_dir)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_lib_isa", None)
    monkeypatch.setattr(cpu_kernels, "_lib_tried", False)
    monkeypatch.delenv("SPECCHECK_CPU_LINEAR", raising=False)
    if fits is not None:
        monkeypatch.setattr(cpu_kernels, "_fitting", lambda: fits)


def _use_kernels():
    """A linear and an RMSNorm, checked against their specifications."""
    x, w = torch.randn(5, 40).bfloat16(), torch.randn(24, 40).bfloat16()
    assert torch.equal(bits(rowinv_linear(x, w)), bits(rowinv_linear_torch(x, w)))
    assert torch.equal(bits(rms_norm(x, None, 1e-6, torch.float32)),
                       bits(rms_norm_torch(x, None, 1e-6, torch.float32)))


def test_a_compiler_that_cannot_build_the_widest_leaves_a_narrower_library(
        tmp_path, monkeypatch, capfd):
    """A compiler that fails for AVX-512 (too old, say) fails only that library at install
    time, with a line, not the install; the engine then loads the AVX2 build (same bits) and
    says so once, not the PyTorch ops (same bits, much slower)."""
    fake = tmp_path / "cc"
    fake.write_text(f'#!/bin/sh\ncase "$*" in *-mavx512f*) echo "no AVX-512 here" >&2; exit 1;; '
                    f'esac\nexec {shlex.join(kernel_build.compiler())} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert sorted(kernel_build.build_all(tmp_path / "lib")) == ["avx2", "generic"]
    err = capfd.readouterr().err
    assert "for avx512 (" in err and "no AVX-512 here" in err
    _fresh(monkeypatch, tmp_path / "lib", ["avx512", "avx2", "generic"])
    _use_kernels()
    _use_kernels()
    assert cpu_kernels.loaded() == "avx2"
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and "avx512: not built" in err[0] and "running the avx2 build" in err[0]


def test_without_a_library_the_pytorch_ops_run_and_say_so_once(tmp_path, monkeypatch, capfd):
    _fresh(monkeypatch, tmp_path / "none")
    _use_kernels()
    _use_kernels()
    assert cpu_kernels.loaded() is None and not cpu_kernels.compiled()
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and "not built" in err[0] and "PyTorch ops (same bits, slower)" in err[0]
    _fresh(monkeypatch, tmp_path / "none")
    monkeypatch.setenv("SPECCHECK_CPU_LINEAR", "torch")  # asked for: nothing to say
    _use_kernels()
    assert cpu_kernels.loaded() is None and capfd.readouterr().err == ""


def test_a_failed_build_is_a_line_not_an_error(tmp_path, monkeypatch):
    """``CC=false`` (a compiler that fails): no library, no exception (the install goes on)."""
    lines = []
    monkeypatch.setenv("CC", "false")
    assert kernel_build.build_all(tmp_path, log=lines.append) == {}
    assert len(lines) == 3 and all("exited with status 1" in ln for ln in lines)
    assert not list(tmp_path.iterdir())  # no half-written library left behind


def test_a_library_built_from_another_source_is_refused(tmp_path, monkeypatch, capfd):
    """A checkout's cpu_kernels.c edited since its libraries were built: they are not loaded."""
    kernel_build.build("generic", tmp_path / kernel_build.library_name("generic"))
    monkeypatch.setattr(cpu_kernels, "_source_sha", lambda: "0" * 64)
    _fresh(monkeypatch, tmp_path, ["generic"])
    assert cpu_kernels.loaded() is None
    assert "generic: built from another cpu_kernels.c" in capfd.readouterr().err
