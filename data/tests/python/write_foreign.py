"""Writes token data in Megatron-LM's and llm.c's published formats, as
their own tools do, from documents given as JSON, for weft-data's tests.

    python write_foreign.py DOCS.json OUT_DIR

DOCS.json: {"docs": [[id, ...], ...]} (GPT-2 ids, no end-of-text).
Writes into OUT_DIR:
  megatron_text_document.bin/.idx  Megatron-LM MMapIndexedDataset, one
      sequence per document, end-of-text appended (preprocess_data.py
      --append-eod), uint16 (dtype code 8), following _IndexWriter.write.
  llmc_all.bin  one llm.c shard (dev/data/data_common.py write_datafile:
      256 int32 header [20240520, 1, ntok, 0...], then uint16 tokens),
      each document preceded by end-of-text (as fineweb.py tokenizes).
  llmc/tiny_val_000000.bin, llmc/tiny_train_000001.bin  the first
      document as llm.c's validation shard, the rest as training.
"""
import json
import os
import struct
import sys

import numpy as np

EOT = 50256


def write_megatron(prefix, docs):
    seqs = [np.array(d + [EOT], dtype=np.uint16) for d in docs]
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes(order="C"))
    lengths = np.array([len(s) for s in seqs], dtype=np.int32)
    pointers = np.zeros(len(seqs), dtype=np.int64)
    if len(seqs) > 1:
        pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64) * 2)
    doc_idx = np.arange(len(seqs) + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", 8))  # uint16
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


def write_llmc(path, docs):
    toks = []
    for d in docs:
        toks.append(EOT)
        toks.extend(d)
    header = np.zeros(256, dtype=np.int32)
    header[0] = 20240520
    header[1] = 1
    header[2] = len(toks)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(toks, dtype=np.uint16).tobytes())


def main():
    docs = json.load(open(sys.argv[1]))["docs"]
    out = sys.argv[2]
    os.makedirs(os.path.join(out, "llmc"), exist_ok=True)
    write_megatron(os.path.join(out, "megatron_text_document"), docs)
    write_llmc(os.path.join(out, "llmc_all.bin"), docs)
    write_llmc(os.path.join(out, "llmc", "tiny_val_000000.bin"), docs[:1])
    write_llmc(os.path.join(out, "llmc", "tiny_train_000001.bin"), docs[1:])
    print("ok", len(docs))


main()
