"""Generates the PyTorch reference fixtures for weft's mixture-of-experts block.

For each small configuration below it writes model/reference/moe/<name>.safetensors
holding one MoE feed-forward block (weft-moe's MoeBlock, as weft-model's MoeFfn)
built independently in PyTorch:

  logits = x @ router.weight                         (N, E)
  s      = softmax(logits) | sigmoid(logits)          router scores
  chosen = top-k of (s + router.selection_bias)       the bias selects only
  g_i    = s_chosen_i            (or s_chosen_i / sum_j s_chosen_j if normalised)
  out    = sum_i g_i * expert_chosen_i(x) [+ shared_expert(x)]
  expert(x) = c_proj(gelu_tanh(c_fc(x)))             GPT-2 MLP, Conv1D layout (x @ W + b)

and, if enabled, the Switch/GShard auxiliary loss
  aux = coef * E * sum_e f_e * P_e
with f_e the fraction of the group's k*n chosen assignments that went to expert e
(no gradient) and P_e the group's mean router probability q_e (softmax, or the
sigmoid scores normalised over experts); the group is the batch, or each sequence
with the result averaged over sequences.

The loss differentiated is  sum(out * dout) + aux  for a random upstream gradient
dout, so the gradients are d/d(input) and d/d(every parameter), router weight
included (the selection bias's gradient is 0: it only selects).

Inputs and parameters are drawn in float32 (what weft computes with) and stored as
float32; the forward and backward run in float64 on those values and the results
(out, aux_loss, router_entropy, grad.*) are stored as float64, so they are the exact
answer up to f64 rounding. Inputs are random and the script checks that every
token's k-th and (k+1)-th selection keys differ by at least MIN_GAP, so top-k has
no ties and no near-ties that float32 rounding could flip.

Tensor names: inp (B,T,C), dout (B,T,C), params under weft's names
(router.weight (C,E), router.selection_bias (E), experts.c_fc.weight (E,C,H),
experts.c_fc.bias (E,H), experts.c_proj.weight (E,H,C), experts.c_proj.bias (E,C),
shared_expert.* when present), out (B,T,C), aux_loss (1), router_entropy (1,
the mean over tokens of -sum_e q_e ln q_e), grad.inp and grad.<param name>.
The configuration is in the file's metadata (all values strings).

Regenerate (deterministic, seeded; needs torch, safetensors, numpy):
    ~/.cache/weft-venv/bin/python model/reference/make_moe_fixtures.py
"""

import json
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe")
MIN_GAP = 1e-3

# name, C, H, E, k, gate, normalize, shared, aux coef (0: off), aux scope, bias, B, T
CASES = [
    ("softmax_top2_e4", 8, 32, 4, 2, "softmax", False, False, 0.0, "batch", False, 2, 5),
    ("softmax_norm_top2_e6_shared_aux_bias", 8, 12, 6, 2, "softmax", True, True, 0.1, "batch", True, 2, 6),
    ("softmax_top1_e4_aux_seq", 6, 10, 4, 1, "softmax", False, False, 0.05, "sequence", False, 3, 4),
    ("sigmoid_norm_top2_e4_shared_aux", 8, 16, 4, 2, "sigmoid", True, True, 0.1, "batch", False, 2, 5),
    ("sigmoid_top3_e8_bias", 4, 16, 8, 3, "sigmoid", False, False, 0.0, "batch", True, 1, 9),
]


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def make_case(gen, c, h, e, k, gate, normalize, shared, aux_coef, bias, b, t):
    """Random float32 inputs and parameters (scaled so routing is not uniform)."""
    n = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen) * s).float()
    p = {
        "router.weight": n(c, e, s=0.7),
        "router.selection_bias": n(e, s=0.3) if bias else torch.zeros(e),
        "experts.c_fc.weight": n(e, c, h, s=0.3),
        "experts.c_fc.bias": n(e, h, s=0.1),
        "experts.c_proj.weight": n(e, h, c, s=0.3),
        "experts.c_proj.bias": n(e, c, s=0.1),
    }
    if shared:
        p.update({
            "shared_expert.c_fc.weight": n(c, h, s=0.3),
            "shared_expert.c_fc.bias": n(h, s=0.1),
            "shared_expert.c_proj.weight": n(h, c, s=0.3),
            "shared_expert.c_proj.bias": n(c, s=0.1),
        })
    inp = n(b, t, c)
    dout = n(b, t, c)
    return p, inp, dout


def scores_of(logits, gate):
    return torch.softmax(logits, -1) if gate == "softmax" else torch.sigmoid(logits)


def probs_of(s, gate):
    return s if gate == "softmax" else s / s.sum(-1, keepdim=True)


def min_gap(p, inp, k, gate):
    """Smallest gap between a token's k-th and (k+1)-th selection keys (float64)."""
    x = inp.double().reshape(-1, inp.shape[-1])
    key = scores_of(x @ p["router.weight"].double(), gate) + p["router.selection_bias"].double()
    e = key.shape[-1]
    if k == e:
        return math.inf
    top = key.sort(-1, descending=True).values
    return (top[:, k - 1] - top[:, k]).min().item()


def reference(p32, inp32, dout32, c, h, e, k, gate, normalize, shared, aux_coef, scope, b, t):
    p = {name: v.double().clone().requires_grad_(True) for name, v in p32.items()}
    x = inp32.double().clone().requires_grad_(True)
    xf = x.reshape(b * t, c)
    logits = xf @ p["router.weight"]
    s = scores_of(logits, gate)
    idx = (s + p["router.selection_bias"]).detach().topk(k, -1).indices  # (N, k)
    g = s.gather(-1, idx)
    if normalize:
        g = g / g.sum(-1, keepdim=True)
    out = torch.zeros(b * t, c, dtype=torch.float64)
    for j in range(e):
        hid = gelu_tanh(xf @ p["experts.c_fc.weight"][j] + p["experts.c_fc.bias"][j])
        y = hid @ p["experts.c_proj.weight"][j] + p["experts.c_proj.bias"][j]
        w = (g * (idx == j)).sum(-1, keepdim=True)  # gate of expert j per token (0 if not chosen)
        out = out + w * y
    if shared:
        hid = gelu_tanh(xf @ p["shared_expert.c_fc.weight"] + p["shared_expert.c_fc.bias"])
        out = out + hid @ p["shared_expert.c_proj.weight"] + p["shared_expert.c_proj.bias"]
    q = probs_of(s, gate)
    aux = torch.zeros((), dtype=torch.float64)
    if aux_coef > 0:
        groups = [range(0, b * t)] if scope == "batch" else [range(i * t, (i + 1) * t) for i in range(b)]
        for grp in groups:
            rows = torch.tensor(list(grp))
            f = torch.zeros(e, dtype=torch.float64)
            for j in range(e):
                f[j] = (idx[rows] == j).sum().double() / (k * len(rows))
            aux = aux + aux_coef * e * (f * q[rows].mean(0)).sum()
        aux = aux / len(groups)
    out = out.reshape(b, t, c)
    loss = (out * dout32.double()).sum() + aux
    loss.backward()
    with torch.no_grad():
        ent = -(q * torch.log(q)).sum(-1).mean()
    grads = {"grad.inp": x.grad}
    for name, v in p.items():
        grads["grad." + name] = v.grad if v.grad is not None else torch.zeros_like(v)
    return out.detach(), aux.detach(), ent, grads


def main():
    os.makedirs(OUT, exist_ok=True)
    for i, (name, c, h, e, k, gate, normalize, shared, aux_coef, scope, bias, b, t) in enumerate(CASES):
        gen = torch.Generator().manual_seed(1000 + i)
        for attempt in range(100):
            p32, inp32, dout32 = make_case(gen, c, h, e, k, gate, normalize, shared, aux_coef, bias, b, t)
            gap = min_gap(p32, inp32, k, gate)
            if gap >= MIN_GAP:
                break
        else:
            raise SystemExit(f"{name}: no draw without near-ties in 100 attempts")
        out, aux, ent, grads = reference(p32, inp32, dout32, c, h, e, k, gate, normalize, shared, aux_coef, scope, b, t)
        tensors = {"inp": inp32, "dout": dout32, "out": out, "aux_loss": aux.reshape(1),
                   "router_entropy": ent.reshape(1)}
        tensors.update(p32)
        tensors.update({n: v.detach() for n, v in grads.items()})
        tensors = {n: v.contiguous() for n, v in tensors.items()}
        meta = {
            "channels": str(c), "hidden": str(h), "experts": str(e), "top_k": str(k), "gate": gate,
            "normalize": json.dumps(normalize), "shared_expert": json.dumps(shared),
            "aux_coef": repr(aux_coef), "aux_scope": scope, "batch": str(b), "seq_len": str(t),
            "min_selection_gap": f"{gap:.3e}", "generator": "model/reference/make_moe_fixtures.py",
            "torch": torch.__version__,
        }
        path = os.path.join(OUT, name + ".safetensors")
        save_file(tensors, path, metadata=meta)
        print(f"{name}: {os.path.getsize(path)} bytes, min top-k gap {gap:.2e} "
              f"(attempt {attempt + 1}), aux {aux.item():.6f}, entropy {ent.item():.6f}")


if __name__ == "__main__":
    main()
