"""Generates the PyTorch reference fixtures for weft-model's tests.

For each small random GPT-2 configuration below it writes, under
model/tests/fixtures/<name>/:
  config.json, model.safetensors  -- the model, saved by transformers'
                                     save_pretrained (float32 weights)
  tokens.json                     -- {"inputs", "targets", "loss", ...}
  grads.safetensors               -- d loss / d parameter for every parameter
                                     under its Hugging Face name

The loss and gradients are computed in float64 (the float32 weights cast
to double), so they are the exact answer up to f64 rounding; weft's f32
results are compared with them. For context the script also records how far
PyTorch's own float32 computation is from the float64 one.

Loss = mean token cross-entropy of logits(inputs) against targets
(F.cross_entropy over all B*T positions; no shift, the targets are given).

Regenerate (deterministic, seeded):
    python -m venv .venv && .venv/bin/pip install torch transformers safetensors numpy
    .venv/bin/python model/reference/make_fixtures.py
"""

import json
import os
import shutil

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")

# name, n_layer, n_head, n_embd, vocab (not multiples of 8), n_positions, tied, B, T
CONFIGS = [
    ("l1_h2_c16_v53_tied", 1, 2, 16, 53, 8, True, 2, 5),
    ("l2_h4_c32_v101_tied", 2, 4, 32, 101, 16, True, 3, 11),
    ("l2_h3_c24_v37_untied", 2, 3, 24, 37, 12, False, 2, 9),
    ("l3_h1_c8_v29_tied_t70", 3, 1, 8, 29, 72, True, 1, 70),
]


def main():
    torch.manual_seed(0)
    for i, (name, n_layer, n_head, n_embd, vocab, n_pos, tied, b, t) in enumerate(CONFIGS):
        cfg = GPT2Config(
            n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab, n_positions=n_pos,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
            activation_function="gelu_new",
        )
        torch.manual_seed(1000 + i)
        model = GPT2LMHeadModel(cfg).eval()
        # Perturb every parameter so no gradient is trivially zero and layer
        # norms/biases are not at their identity initialisation.
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    base = 1.0 if ".ln_" in pname or "ln_f" in pname else 0.0
                    p.copy_(base + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.3 * torch.randn_like(p))
        inputs = torch.randint(0, vocab, (b, t))
        targets = torch.randint(0, vocab, (b, t))

        out = os.path.join(ROOT, name)
        if os.path.exists(out):
            shutil.rmtree(out)
        model.save_pretrained(out, safe_serialization=True)
        gen = os.path.join(out, "generation_config.json")
        if os.path.exists(gen):
            os.remove(gen)

        def loss_and_grads(m):
            m.zero_grad()
            logits = m(inputs).logits
            loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
            loss.backward()
            return loss.item(), {n: p.grad.detach().clone() for n, p in m.named_parameters()}

        loss32, g32 = loss_and_grads(model)
        m64 = GPT2LMHeadModel.from_pretrained(out, attn_implementation="eager").double().eval()
        loss64, g64 = loss_and_grads(m64)
        # named_parameters() lists a tied lm_head once, as transformer.wte.weight,
        # whose gradient then includes the lm_head contribution.
        save_file({n: g.float().contiguous() for n, g in g64.items()}, os.path.join(out, "grads.safetensors"))
        torch_f32_err = {
            n: ((g32[n].double() - g64[n]).abs().max() / g64[n].abs().max()).item() for n in g64
        }
        with open(os.path.join(out, "tokens.json"), "w") as f:
            json.dump({
                "inputs": inputs.tolist(),
                "targets": targets.tolist(),
                "loss": loss64,
                "torch_f32_loss": loss32,
                "torch_f32_max_rel_grad_err": max(torch_f32_err.values()),
            }, f)
        print(f"{name}: loss {loss64:.10f} (torch f32 rel err {abs(loss32 - loss64) / loss64:.2e}, "
              f"worst grad rel err {max(torch_f32_err.values()):.2e})")


if __name__ == "__main__":
    main()
