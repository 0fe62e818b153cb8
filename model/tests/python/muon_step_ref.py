"""A whole model's optimizer step in torch, for model/tests/muon_torch.rs."""
# The reference step: torch's Muon and AdamW on the tensors of
# `DIR/spec.txt`, from `DIR/p0.f32` and `DIR/g.f32` (the whole layout,
# raw little-endian f32); writes the parameters after the step and the
# first and second moments, in the same layout, to `DIR/p1.f32`,
# `DIR/m1.f32`, `DIR/v1.f32` (Muon's momentum buffer as the first moment,
# zeros as its second).
#
# `spec.txt`: a line of hyper-parameters, then one line per Muon matrix
# (`muon OFFSET ROWS WIDTH C0 C1`: columns C0..C1 of the ROWS × WIDTH
# `[in, out]` block at OFFSET) and one per AdamW tensor (`adamw OFFSET
# LEN DECAY`).
import sys
from pathlib import Path

import numpy as np
import torch
import torch.optim._muon as muon_mod

# torch's Newton-Schulz patched to f32, shared with the kernel's check
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "kernels" / "tests" / "python"))
from muon_ref import zeropower_f32  # noqa: E402


def main(d):
    lines = (d / "spec.txt").read_text().splitlines()
    h = lines[0].split()
    mlr, mwd, mom = float(h[1]), float(h[2]), float(h[3])
    nesterov, ns_steps = h[4] == "1", int(h[5])
    coeffs = (float(h[6]), float(h[7]), float(h[8]))
    meps, adjust = float(h[9]), h[10]
    alr, b1, b2, aeps, awd = (float(x) for x in h[11:16])
    p0 = np.fromfile(d / "p0.f32", dtype="<f4")
    g = np.fromfile(d / "g.f32", dtype="<f4")
    p1, m1, v1 = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)

    def param(values, grad):
        t = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(values)))
        t.grad = torch.from_numpy(np.ascontiguousarray(grad))
        return t

    muon, decay, no_decay, placed = [], [], [], []
    for line in lines[1:]:
        f = line.split()
        if f[0] == "muon":
            off, rows, width, c0, c1 = map(int, f[1:])
            block = lambda x: x[off : off + rows * width].reshape(rows, width)[:, c0:c1].T
            t = param(block(p0), block(g))  # torch's [out, in]
            muon.append(t)
            placed.append((f[0], t, (off, rows, width, c0, c1)))
        else:
            off, n, dec = map(int, f[1:])
            t = param(p0[off : off + n], g[off : off + n])
            (decay if dec == 1 else no_decay).append(t)
            placed.append((f[0], t, (off, n)))

    muon_mod._zeropower_via_newtonschulz = zeropower_f32
    mopt = torch.optim.Muon(
        muon,
        lr=mlr,
        weight_decay=mwd,
        momentum=mom,
        nesterov=nesterov,
        ns_coefficients=coeffs,
        eps=meps,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust,
    )
    mopt.step()
    groups = [{"params": decay, "weight_decay": awd}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    aopt = torch.optim.AdamW(groups, lr=alr, betas=(b1, b2), eps=aeps)
    aopt.step()

    for kind, t, where in placed:
        if kind == "muon":
            off, rows, width, c0, c1 = where
            view = lambda x: x[off : off + rows * width].reshape(rows, width)
            view(p1)[:, c0:c1] = t.detach().numpy().T
            view(m1)[:, c0:c1] = mopt.state[t]["momentum_buffer"].numpy().T
        else:
            off, n = where
            p1[off : off + n] = t.detach().numpy()
            m1[off : off + n] = aopt.state[t]["exp_avg"].numpy()
            v1[off : off + n] = aopt.state[t]["exp_avg_sq"].numpy()
    for name, x in (("p1", p1), ("m1", m1), ("v1", v1)):
        x.astype("<f4").tofile(d / f"{name}.f32")


main(Path(sys.argv[1]))
