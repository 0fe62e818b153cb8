"""Generates the transformers reference fixtures for weft-model's
Llama-family tests: LlamaForCausalLM (grouped- and multi-query attention,
Llama-3 rotary scaling, tied and untied), Qwen3ForCausalLM (QK-norm, a head
size set apart from the width, local/global sliding-window layers),
MistralForCausalLM (a sliding window on every layer) and Qwen2ForCausalLM
(query/key/value biases).

For each small random configuration below it writes, under
model/tests/fixtures-llama/<name>/:
  config.json, model.safetensors  -- the model, saved by transformers'
                                     save_pretrained (float32 weights)
  tokens.json                     -- {"inputs", "targets", "loss", ...}
  grads.safetensors               -- d loss / d parameter for every parameter
                                     under its transformers name

The loss and gradients are computed in float64 (the float32 weights cast to
double, eager attention), so they are the exact answer up to f64 rounding.
One change to transformers' model: its rotary embedding computes its
cosines and sines in float32 whatever the model's dtype (a float32
`inv_freq`, float32 angles); here they are computed in float64 (the same
formulas, and for Llama-3 scaling the same steps as transformers'
`_compute_llama3_parameters`), so the reference is the float64 answer.

Loss = mean token cross-entropy of logits(inputs) against targets.

Regenerate (deterministic, seeded):
    python -m venv .venv && .venv/bin/pip install torch transformers safetensors numpy
    .venv/bin/python model/reference/make_llama_fixtures.py
"""

import json
import math
import os
import shutil
import types

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures-llama")

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# name, model class, config, B, T
CONFIGS = [
    ("llama_gqa_untied", LlamaForCausalLM, LlamaConfig(
        hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=53, max_position_embeddings=16,
        tie_word_embeddings=False), 2, 9),
    ("llama3_mqa_tied_t70", LlamaForCausalLM, LlamaConfig(
        hidden_size=24, intermediate_size=36, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=37, max_position_embeddings=72,
        tie_word_embeddings=True, rope_parameters=LLAMA3), 1, 70),
    ("qwen3_qknorm_hd6", Qwen3ForCausalLM, Qwen3Config(
        hidden_size=16, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=6, vocab_size=41, max_position_embeddings=16,
        tie_word_embeddings=False), 2, 7),
    ("qwen3_local_global", Qwen3ForCausalLM, Qwen3Config(
        hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, vocab_size=29, max_position_embeddings=16,
        tie_word_embeddings=False, use_sliding_window=True, sliding_window=3,
        max_window_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]), 1, 12),
    ("mistral_window4", MistralForCausalLM, MistralConfig(
        hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, vocab_size=31, max_position_embeddings=16, sliding_window=4,
        tie_word_embeddings=False), 2, 11),
    ("qwen2_qkv_bias", Qwen2ForCausalLM, Qwen2Config(
        hidden_size=16, intermediate_size=28, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=23, max_position_embeddings=16,
        tie_word_embeddings=False), 2, 6),
]


def inv_freq_f64(config, module):
    """transformers' inverse frequencies, in float64."""
    rope = config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(dim * rope.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope.get("rope_type", "default") == "llama3":
        # _compute_llama3_parameters, step for step.
        factor = rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rotary_in_f64(model):
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.inv_freq64 = inv_freq_f64(model.config, module)

            def forward(self, x, position_ids):
                freqs = position_ids[..., None].double() * self.inv_freq64
                emb = torch.cat((freqs, freqs), dim=-1)
                cos = emb.cos() * self.attention_scaling
                sin = emb.sin() * self.attention_scaling
                return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

            module.forward = types.MethodType(forward, module)


def main():
    for i, (name, cls, cfg, b, t) in enumerate(CONFIGS):
        torch.manual_seed(2000 + i)
        model = cls(cfg).eval()
        # Perturb every parameter so no gradient is trivially zero and the
        # norms are not at their identity initialisation.
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

        m64 = cls.from_pretrained(out, attn_implementation="eager").double().eval()
        rotary_in_f64(m64)
        m64.zero_grad()
        logits = m64(inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        # named_parameters() lists a tied lm_head once, as the embedding,
        # whose gradient then includes the lm_head contribution.
        grads = {n: p.grad.detach().float().contiguous() for n, p in m64.named_parameters()}
        save_file(grads, os.path.join(out, "grads.safetensors"))
        with open(os.path.join(out, "tokens.json"), "w") as f:
            json.dump({"inputs": inputs.tolist(), "targets": targets.tolist(),
                       "loss": loss.item()}, f)
        print(f"{name}: loss {loss.item():.10f}, {len(grads)} gradients")


if __name__ == "__main__":
    main()
