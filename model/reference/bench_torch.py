"""PyTorch baseline for weft's train_step bench: the same configurations,
transformers' GPT2LMHeadModel (a, b) and LlamaForCausalLM (l) (dropout 0,
default attention implementation), AdamW, on the CPU with the same thread
count.

    python model/reference/bench_torch.py [a|b]... [--steps N] [--threads N] [--precision fp32|bf16|fp16|both|all]

bf16 is PyTorch's CPU mixed precision: the forward and the loss under
`torch.autocast("cpu", dtype=torch.bfloat16)` (bf16 matrix products on
oneDNN: AMX or AVX512-BF16 where the CPU has them), f32 master weights
and the same AdamW; fp16 the same with `dtype=torch.float16` (no loss
scaling: timing only).

Prints a table in the same format as `cargo bench -p weft-model --bench
train_step`, counting FLOPs the same way (6·N per token, N = all
parameters with the tied head once and an untied input embedding not at
all, plus 6·L·T·C per token for causal attention). Tokens/s use the best (shortest) timed step, as weft's bench.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

CASES = {
    "a": dict(n_layer=4, n_head=4, n_embd=256, vocab_size=50304, n_positions=1024, b=8, t=256),
    "b": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024, b=4, t=256),
    "l": dict(llama=True, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
              hidden_size=768, intermediate_size=2048, vocab_size=32000,
              max_position_embeddings=1024, tie_word_embeddings=False, b=4, t=256),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=list(CASES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16", "both", "all"], default="fp32")
    ap.add_argument("--mode", default=None, help="accepted for weft's bench's flags; ignored")
    args = ap.parse_args()
    precisions = {"both": ["fp32", "bf16"], "all": ["fp32", "bf16", "fp16"]}.get(
        args.precision, [args.precision]
    )
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads: {torch.get_num_threads()}, steps: {args.steps} (after 1 warm-up)")
    print("| config | precision | params | B | T | best s/step | mean s/step | tokens/s | GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, precision in [(n, p) for n in args.cases for p in precisions]:
        c = dict(CASES[name])
        b, t = c.pop("b"), c.pop("t")
        torch.manual_seed(0)
        if c.pop("llama", False):
            cfg = LlamaConfig(**c, rms_norm_eps=1e-5, rope_theta=500000.0)
            model = LlamaForCausalLM(cfg).train()
            layers, width = cfg.num_hidden_layers, cfg.hidden_size
        else:
            cfg = GPT2Config(**c, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new")
            model = GPT2LMHeadModel(cfg).train()
            layers, width = cfg.n_layer, cfg.n_embd
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        x = torch.randint(0, cfg.vocab_size, (b, t))
        y = torch.randint(0, cfg.vocab_size, (b, t))

        def step():
            opt.zero_grad(set_to_none=True)
            dtype = torch.float16 if precision == "fp16" else torch.bfloat16
            with torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32"):
                logits = model(x).logits
                loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
            loss.backward()
            opt.step()

        step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        secs, mean = min(times), sum(times) / len(times)
        n = sum(p.numel() for p in model.parameters())
        lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * width
        flops_per_token = 6 * (n - lookup) + 6 * layers * t * width
        tps = b * t / secs
        print(f"| {name} | {precision} | {n / 1e6:.1f}M | {b} | {t} | {secs:.3f} | {mean:.3f} | {tps:.0f} | {tps * flops_per_token / 1e9:.1f} |")


if __name__ == "__main__":
    main()
