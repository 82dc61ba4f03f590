"""Triton symmetric-product kernels and the Triton Newton-Schulz backend vs the torch reference.

On CPU the kernels run under triton's interpreter, which must be switched on before triton is
first imported. So that the switch never leaks into other test modules, this module has two
halves: in the normal pytest process it runs *itself* in a subprocess with
``TRITON_INTERPRET=1`` (one test, which fails with the subprocess's report); in that subprocess
(or on a GPU machine, where ``DMUON_TEST_CUDA=1`` is not needed: CUDA is used when present) the
real tests run. Shapes stay tiny: the interpreter runs ~0.2 s per Newton-Schulz step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")

if not _IN_INTERPRETER:

    def test_triton_kernels_under_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1")
        root = Path(__file__).resolve().parent.parent
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-x", "-p", "no:cacheprovider"],
            cwd=root, env=env, capture_output=True, text=True, timeout=240,
        )
        assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"

    def test_triton_backend_refuses_cpu_without_interpreter():
        from dmuon.kernels import newton_schulz

        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            newton_schulz(torch.randn(8, 16), backend="triton")
        # "auto" never picks Triton on CPU: identical to the torch backend.
        G = torch.randn(8, 16)
        assert torch.equal(newton_schulz(G, backend="auto"), newton_schulz(G, backend="torch"))

else:
    from dmuon.kernels import newton_schulz
    from dmuon.kernels.launch_configs import LaunchConfig
    from dmuon.kernels.newton_schulz import torch_mm
    from dmuon.kernels.triton_syrk import triton_sym_mm

    _DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    # Relative Frobenius error vs float64, per input dtype: a few units of roundoff of the output
    # dtype (fp16 2^-11, bf16 2^-8) since accumulation is fp32.
    _PRODUCT_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
    _SMALL_TILES = LaunchConfig(block=16, block_k=16, num_warps=1, num_stages=1)

    def _rel(out, ref):
        return ((out.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    @pytest.mark.parametrize("shape", [(17, 33), (48, 40), (1, 64), (64, 64), (3, 20, 36)])
    def test_syrk_matches_float64_and_is_symmetric(shape, dtype):
        torch.manual_seed(0)
        X = torch.randn(shape, device=_DEVICE).to(dtype)
        ref = X.double() @ X.double().mT
        for config in (None, _SMALL_TILES):  # 16-tiles: several tile rows, partial and mirrored tiles
            S = triton_sym_mm(X, X.mT, config=config)
            assert S.dtype == dtype and S.shape == ref.shape
            assert torch.equal(S, S.mT)
            assert _rel(S, ref) < _PRODUCT_TOL[dtype]
            # and agrees with the torch reference op to the same tolerance
            assert _rel(S, torch_mm(X, X.mT).double()) < _PRODUCT_TOL[dtype]

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_sym_mm_of_commuting_symmetric_matrices_with_c(dtype):
        torch.manual_seed(1)
        X = torch.randn(2, 40, 56, dtype=torch.float64) / 56**0.5
        R = X @ X.mT
        Z = -1.5 * R + 0.5 * R @ R  # a polynomial in R: commutes with R
        alpha, beta = 0.7, -1.25
        ref = alpha * R @ Z + beta * R
        out = triton_sym_mm(R.to(dtype), Z.to(dtype), R.to(dtype), alpha=alpha, beta=beta, config=_SMALL_TILES)
        assert torch.equal(out, out.mT)
        assert _rel(out, ref) < _PRODUCT_TOL[dtype]

    def test_non_contiguous_input_and_shape_errors():
        torch.manual_seed(2)
        X = torch.randn(40, 24).half().T  # [24, 40] view with strides (1, 24)
        assert _rel(triton_sym_mm(X, X.mT), X.double() @ X.double().T) < _PRODUCT_TOL[torch.float16]
        with pytest.raises(ValueError, match="shape"):
            triton_sym_mm(torch.randn(4, 8).half(), torch.randn(8, 5).half())
        with pytest.raises(ValueError, match="dtype"):
            triton_sym_mm(torch.randn(4, 8).half(), torch.randn(8, 4).bfloat16())

    def _ns_float64(G, coeffs):
        """Textbook standard iteration in float64."""
        X = G.double()
        tall = X.shape[-2] > X.shape[-1]
        X = X.mT if tall else X
        X = X / X.norm(dim=(-2, -1), keepdim=True)
        for a, b, c in coeffs:
            A = X @ X.mT
            X = a * X + (b * A + c * A @ A) @ X
        return X.mT if tall else X

    # fp16 (the default) on every shape and method; bf16 on a few (the interpreter is slow).
    # A square matrix runs the standard iteration for either method, so 64x64 appears once.
    _NS_CASES = [
        (shape, method, torch.float16)
        for shape in [(17, 33), (48, 40), (1, 64), (3, 20, 36)]
        for method in ("gram", "standard")
    ] + [((64, 64), "standard", torch.float16), ((48, 40), "gram", torch.bfloat16),
         ((48, 40), "standard", torch.bfloat16), ((3, 20, 36), "gram", torch.bfloat16)]

    @pytest.mark.parametrize("shape, method, dtype", _NS_CASES)
    def test_newton_schulz_triton_vs_torch_backend_and_float64(shape, method, dtype):
        """Both backends against one float64 iteration with the same coefficients.

        Standard: the kernels only change the rounding of X X^T and A^2, so the error matches
        torch's within a few percent. Gram: keeping one triangle and mirroring (instead of the
        slightly asymmetric full product) measured 1.2-1.9x torch's error at these shapes on CPU
        (the same happens with a torch ``tril``-and-mirror op set), still 5-10x below
        torch.optim.Muon's bf16 error in fp16; allow 2.5x.
        """
        from dmuon.kernels import resolve_coefficients

        torch.manual_seed(3)
        G = torch.randn(shape, device=_DEVICE)
        ref = _ns_float64(G.cpu(), resolve_coefficients("polar_express", 5))
        torch_err = _rel(newton_schulz(G, method=method, dtype=dtype, backend="torch").cpu(), ref)
        out = newton_schulz(G, method=method, dtype=dtype, backend="triton")
        assert out.dtype == dtype and out.shape == G.shape
        factor = 1.2 if method == "standard" else 2.5
        assert _rel(out.cpu(), ref) <= factor * torch_err + 1e-3, (_rel(out.cpu(), ref), torch_err)
