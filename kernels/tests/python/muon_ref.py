"""Reference for kernels/tests/muon_torch.rs: torch.optim.Muon on the
matrices and gradients that the Rust test writes.

Usage: muon_ref.py DIR. DIR/cases.txt has one case a line:

    name rows cols steps lr weight_decay momentum nesterov(0|1) adjust_lr_fn ns(f32|bf16)

with rows x cols torch's [out, in]; DIR/name.p0.f32 holds the initial
parameter and DIR/name.g.f32 the `steps` gradients (raw little-endian f32,
row-major). Writes DIR/name.out.f32, the parameter after the steps.

ns = bf16 runs torch's Muon as it is (Newton-Schulz in bfloat16); ns = f32
runs it with `_zeropower_via_newtonschulz` replaced by the same code in
float32, to check the rest at f32 tolerance.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.optim._muon as muon_mod

ORIGINAL_NS = muon_mod._zeropower_via_newtonschulz


def zeropower_f32(grad, ns_coefficients, ns_steps, eps):
    """torch's _zeropower_via_newtonschulz with dtype=torch.float32."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100")
    if len(grad.shape) != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    ortho_grad = grad.to(dtype=torch.float32, copy=True)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def main(d: Path) -> None:
    for line in (d / "cases.txt").read_text().splitlines():
        name, rows, cols, steps, lr, wd, mom, nesterov, adjust, ns = line.split()
        rows, cols, steps = int(rows), int(cols), int(steps)
        p0 = np.fromfile(d / f"{name}.p0.f32", dtype="<f4").reshape(rows, cols)
        g = np.fromfile(d / f"{name}.g.f32", dtype="<f4").reshape(steps, rows, cols)
        muon_mod._zeropower_via_newtonschulz = zeropower_f32 if ns == "f32" else ORIGINAL_NS
        param = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        opt = torch.optim.Muon(
            [param],
            lr=float(lr),
            weight_decay=float(wd),
            momentum=float(mom),
            nesterov=nesterov == "1",
            adjust_lr_fn=adjust,
        )
        for s in range(steps):
            param.grad = torch.from_numpy(g[s].copy())
            opt.step()
        param.detach().numpy().astype("<f4").tofile(d / f"{name}.out.f32")
    muon_mod._zeropower_via_newtonschulz = ORIGINAL_NS


if __name__ == "__main__":
    main(Path(sys.argv[1]))
