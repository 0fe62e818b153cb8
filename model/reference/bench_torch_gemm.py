"""PyTorch's bf16 GEMM at the products of `cargo bench -p weft-kernels
--bench bf16_gemm`: GPT-2 small's linear layers (B·T = 1024 rows, C = 768;
each layer's weight `w` is `in × out`, as there) — the forward `x · w`, the
input gradient `dy · wᵀ` and the weight gradient `xᵀ · dy` — and the three
products of the tied head (V = 50257, the weight `V × C`: `x · Wᵀ`,
`dy · W`, `dyᵀ · x`), on bf16 tensors (oneDNN: AMX or AVX512-BF16 where the
CPU has them), with the same thread count.

    python model/reference/bench_torch_gemm.py [REPS] [--threads N]

Each figure is the best of REPS (default 5) timed calls after one warm-up;
the table has the bench's row names and its "buf ms" column's meaning
(bf16 operands, f32 accumulation; PyTorch's output is bf16, weft's f32).
"""

import argparse
import time

import torch

N, C, V = 1024, 768, 50257


def best(reps, f):
    f()
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t = min(t, time.perf_counter() - t0)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("reps", nargs="?", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bf = torch.bfloat16
    print(f"# torch {torch.__version__}, {args.threads} threads, bf16 operands")
    print(f"{'product':<28} {'ms':>8} {'GF/s':>8}")
    rows = []
    for name, ic, oc in [("c_attn", C, 3 * C), ("attn.c_proj", C, C), ("c_fc", C, 4 * C), ("mlp.c_proj", 4 * C, C)]:
        x, w, dy = torch.randn(N, ic, dtype=bf), torch.randn(ic, oc, dtype=bf), torch.randn(N, oc, dtype=bf)
        for kind, f in [("fwd", lambda: x @ w), ("dx", lambda: dy @ w.t()), ("dw", lambda: x.t() @ dy)]:
            rows.append((f"{kind} {name} {ic}x{oc}", 2 * N * ic * oc, best(args.reps, f)))
    layers = list(rows)
    x, w, dy = torch.randn(N, C, dtype=bf), torch.randn(V, C, dtype=bf), torch.randn(N, V, dtype=bf)
    head = []
    for kind, f in [("fwd", lambda: x @ w.t()), ("dx", lambda: dy @ w), ("dw", lambda: dy.t() @ x)]:
        head.append((f"{kind} lm_head {C}x{V}", 2 * N * C * V, best(args.reps, f)))
    rows += head

    def line(label, flops, t):
        print(f"{label:<28} {t * 1e3:>8.2f} {flops / t / 1e9:>8.1f}")

    for r in layers:
        line(*r)
    line("all twelve", sum(r[1] for r in layers), sum(r[2] for r in layers))
    for r in head:
        line(*r)
    line("lm_head's three", sum(r[1] for r in head), sum(r[2] for r in head))
    line("all (12 layers + head)", sum(r[1] for r in rows), sum(r[2] for r in rows))


if __name__ == "__main__":
    main()
