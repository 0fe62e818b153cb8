"""Builds Hugging Face tokenizers with the Python `tokenizers` library and
encodes a test corpus with them, for weft-data's tests (nothing is
downloaded: the tokenizers are trained here, on a generated corpus).

    python hf_tokenizers.py OUT_DIR

Writes into OUT_DIR:
  bytelevel.json  a byte-level BPE (models.BPE + pre_tokenizers.ByteLevel,
      BpeTrainer with initial_alphabet = ByteLevel.alphabet(), as GPT-2,
      Llama-3 and Qwen build theirs), special token <|endoftext|>.
  wordbpe.json    a plain BPE with a Whitespace pre-tokenizer, an NFC
      normalizer and an unknown token [UNK]; end-of-text </s>.
  llama3.json     a byte-level BPE pre-tokenized as Llama-3's tokenizer.json
      is (a Split on its regex, lookahead included, then ByteLevel
      without its own regex), end-of-text <|end_of_text|>.
  big.json        bytelevel.json with 70,000 added tokens <extra_N>, so
      ids go past 65,535 (vocabulary > 65,536).
  docs/doc000.txt ...  the test documents (unicode, emoji, whitespace
      runs, digits, a spelled-out <|endoftext|>), byte for byte.
  ids.json        {"bytelevel": [[id, ...] per document], "wordbpe": ...,
      "big": ..., "vocab": {"bytelevel": V, ...}, "eot": {...}}, encoded
      as weft encodes documents: encode_special_tokens = True,
      encode(text, add_special_tokens=False).
"""
import json
import os
import random
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

out = sys.argv[1]
os.makedirs(os.path.join(out, "docs"), exist_ok=True)

rng = random.Random(1234)
words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "über",
         "naïve", "café", "日本語", "テキスト", "данные", "λόγος", "🙂", "🚀", "👩‍💻",
         "2026", "3.14159", "token", "tokenizer", "weft", "shard", "ids"]
words += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
          for _ in range(400)]


def sentence(n):
    return " ".join(rng.choice(words) for _ in range(n))


train = [sentence(rng.randint(5, 40)) + rng.choice([".", "!", "?", "\n", "\n\n"])
         for _ in range(3000)]

docs = [
    "Hello world. The quick brown fox jumps over the lazy dog.",
    "Numbers: 0 1 12 123 1234 12345 3.14159 2026-12-06 1e-9 0x1F",
    "Unicode: über naïve café — 日本語のテキスト, данные, λόγος; emoji 🙂🚀👩‍💻 and 🏳️‍🌈!",
    "Whitespace   runs\t\ttabs\n\n\nnewlines  \n   trailing   ",
    "A spelled-out <|endoftext|> inside a document, and </s> too.",
    "   leading spaces and unseen characters: ℵ ∑ ∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \r\n windows line end",
]
docs += [sentence(rng.randint(1, 60)) + "\n" for _ in range(30)]
# added tokens past id 65,535 near the start (training split) and at the
# end (validation split)
docs.insert(1, "extra tokens: <extra_0> <extra_65535><extra_69999> and text")
docs.append("the end <extra_65536> <extra_69998> and a few more words, so that the last window holds them")

for i, d in enumerate(docs):
    with open(os.path.join(out, "docs", f"doc{i:03}.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(d)

# (a) byte-level BPE
bl = Tokenizer(models.BPE())
bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bl.decoder = decoders.ByteLevel()
bl.train_from_iterator(train, trainers.BpeTrainer(
    vocab_size=700, special_tokens=["<|endoftext|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
bl.save(os.path.join(out, "bytelevel.json"))

# (b) plain BPE over whitespace-split words
wb = Tokenizer(models.BPE(unk_token="[UNK]"))
wb.normalizer = normalizers.NFC()
wb.pre_tokenizer = pre_tokenizers.Whitespace()
wb.train_from_iterator(train, trainers.BpeTrainer(
    vocab_size=400, special_tokens=["[UNK]", "</s>"], show_progress=False))
wb.save(os.path.join(out, "wordbpe.json"))

# (a') Llama-3's pre-tokenizer (Qwen2's differs in \p{N} for \p{N}{1,3})
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
l3 = Tokenizer(models.BPE())
l3.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
l3.decoder = decoders.ByteLevel()
l3.train_from_iterator(train, trainers.BpeTrainer(
    vocab_size=800, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
l3.save(os.path.join(out, "llama3.json"))

# (c) a vocabulary over 65,536 ids
big = Tokenizer.from_file(os.path.join(out, "bytelevel.json"))
big.add_tokens([f"<extra_{i}>" for i in range(70000)])
big.save(os.path.join(out, "big.json"))

ids, vocab, eot = {}, {}, {}
for name, tok, end in [("bytelevel", bl, "<|endoftext|>"), ("wordbpe", wb, "</s>"),
                       ("llama3", l3, "<|end_of_text|>"), ("big", big, "<|endoftext|>")]:
    tok = Tokenizer.from_file(os.path.join(out, f"{name}.json"))
    tok.encode_special_tokens = True
    ids[name] = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    vocab[name] = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    eot[name] = tok.token_to_id(end)
with open(os.path.join(out, "ids.json"), "w") as f:
    json.dump({**ids, "vocab": vocab, "eot": eot}, f)
