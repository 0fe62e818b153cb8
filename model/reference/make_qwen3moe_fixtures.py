"""Generates the transformers reference fixtures for weft-model's
Qwen3-MoE test: Qwen3MoeForCausalLM with fine-grained SwiGLU experts
(top-k of 6 or 8, softmax over every expert, `norm_topk_prob` true and
false), grouped-query attention with QK-norm, dense first layers
(`mlp_only_layers`), tied and untied embeddings.

For each small random configuration below it writes, under
model/tests/fixtures-qwen3moe/<name>/:
  config.json, model.safetensors  -- the model, saved by transformers'
                                     save_pretrained (float32 weights,
                                     experts per expert as on the Hub)
  tokens.json                     -- {"inputs", "targets", "loss",
                                      "min_gap"}
  grads.safetensors               -- d loss / d parameter for every
                                     parameter under its saved name (the
                                     fused expert gradients split per
                                     expert as save_pretrained splits the
                                     weights)

The loss and gradients are computed in float64: the float32 weights cast
to double, eager attention, and the experts' eager implementation
(`experts_implementation="eager"`: a loop of `F.linear` per expert;
transformers' default `grouped_mm` has no float64 kernel). The rotary
cosines and sines are computed in float64 as in make_llama_fixtures.py.
So the reference is the float64 answer and the Rust test holds weft's
f32 training arithmetic to the Llama family's tolerances.

Loss = mean token cross-entropy of logits(inputs) against targets: the
plain language-model loss (transformers adds its router auxiliary loss
only with `output_router_logits`, which is off).

`min_gap` is the smallest margin, over every token and expert layer,
between the k-th and the (k+1)-th routing probability: f32 rounding
(about 1e-7 relative) cannot flip a choice with a margin far above it.

Regenerate (deterministic, seeded):
    python -m venv .venv && .venv/bin/pip install torch transformers safetensors numpy
    .venv/bin/python model/reference/make_qwen3moe_fixtures.py
"""

import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_llama_fixtures import rotary_in_f64  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures-qwen3moe")

# name, config, B, T
CONFIGS = [
    ("top2of8_norm_dense0", Qwen3MoeConfig(
        hidden_size=16, intermediate_size=24, moe_intermediate_size=6, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=6, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], vocab_size=41,
        max_position_embeddings=16, tie_word_embeddings=False), 2, 7),
    ("top2of8_nonorm_tied", Qwen3MoeConfig(
        hidden_size=24, intermediate_size=20, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[], vocab_size=37,
        max_position_embeddings=16, tie_word_embeddings=True), 2, 9),
    ("top3of6_norm_dense01", Qwen3MoeConfig(
        hidden_size=16, intermediate_size=32, moe_intermediate_size=4, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=6,
        num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0, 1], vocab_size=29,
        max_position_embeddings=16, tie_word_embeddings=False), 1, 12),
]


def split_expert_grads(grads):
    """The fused expert gradients under save_pretrained's per-expert names."""
    out = {}
    for name, g in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            h = g.shape[1] // 2
            for e in range(g.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = g[e, :h].contiguous()
                out[f"{base}{e}.up_proj.weight"] = g[e, h:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = g[e].contiguous()
        else:
            out[name] = g
    return out


def main():
    for i, (name, cfg, b, t) in enumerate(CONFIGS):
        torch.manual_seed(3000 + i)
        model = Qwen3MoeForCausalLM(cfg).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    base = 1.0 if "norm" in pname else 0.0
                    p.copy_(base + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.3 * torch.randn_like(p))
        vocab = cfg.vocab_size
        inputs = torch.randint(0, vocab, (b, t))
        targets = torch.randint(0, vocab, (b, t))

        out = os.path.join(ROOT, name)
        if os.path.exists(out):
            shutil.rmtree(out)
        model.save_pretrained(out, safe_serialization=True)
        gen = os.path.join(out, "generation_config.json")
        if os.path.exists(gen):
            os.remove(gen)

        m64 = Qwen3MoeForCausalLM.from_pretrained(
            out, attn_implementation="eager", experts_implementation="eager").double().eval()
        rotary_in_f64(m64)
        gaps = []

        def record_gap(module, args, output):
            probs = torch.softmax(output[0].double(), dim=-1)
            top = torch.topk(probs, module.top_k + 1, dim=-1).values
            gaps.append((top[:, -2] - top[:, -1]).min().item())

        for module in m64.modules():
            if type(module).__name__ == "Qwen3MoeTopKRouter":
                module.register_forward_hook(record_gap)
        m64.zero_grad()
        logits = m64(inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        grads = {n: p.grad.detach().float().contiguous() for n, p in m64.named_parameters()}
        save_file(split_expert_grads(grads), os.path.join(out, "grads.safetensors"))
        with open(os.path.join(out, "tokens.json"), "w") as f:
            json.dump({"inputs": inputs.tolist(), "targets": targets.tolist(),
                       "loss": loss.item(), "min_gap": min(gaps)}, f)
        print(f"{name}: loss {loss.item():.10f}, {len(grads)} gradients, "
              f"smallest routing margin {min(gaps):.2e}")


if __name__ == "__main__":
    main()
