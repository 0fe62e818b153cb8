//! Pretraining data at scale: text tokenized once into token shards,
//! memory-mapped in training, blended, and handed out in an order that is
//! a pure function of `(seed, sample number)` — and the two small sources
//! a run can start from without preparing anything, the synthetic
//! language with a known loss floor and text tokenized as the run starts.
//!
//! - [`DataSpec`] and [`Source`]: what a run trains on (a job file's
//!   `[data]` table), and [`Dataset`]: its training and validation
//!   batches as pure functions of the step and the micro-batch, from any
//!   source.
//! - [`SyntheticLanguage`] ([`mod@synthetic`]): a seeded language whose
//!   next-token distribution is known at every position, so the loss
//!   floor is exact. [`TextData`] ([`mod@text`]): `.txt` files tokenized
//!   when a run starts, with a checksummed token cache that later runs
//!   and the other ranks of a job map instead. [`Tokenizer`]: GPT-2's
//!   BPE (the default) or a Hugging Face `tokenizer.json`
//!   ([`mod@tokenizer`]), whose end-of-text token, vocabulary size and
//!   identity travel with the data it makes.
//! - [`prepare()`]: `.txt` / `.jsonl` (optionally gzip) files and folders
//!   → shards of token ids (`u16`, or `u32` for vocabularies over 65,536)
//!   plus an index with checksums and the tokenizer ([`mod@format`]); parallel over the cores, byte-identical for the same
//!   input whatever the thread count, resumable after an interruption.
//! - [`Corpus`]: opens such a folder, a Megatron-LM `.bin`/`.idx` pair or
//!   llm.c `.bin` shards (GPT-2's or Llama-3's), memory-mapped (a rank reads only the pages of
//!   the sequences it trains on), split into training and validation by
//!   document.
//! - [`Loader`]: sequences of `seq + 1` tokens from one corpus or a
//!   weighted blend ([`Interleave`]), each epoch a fresh seeded shuffle
//!   ([`Permutation`]); sample `g` is the same sequence on every layout
//!   and after every restart, because nothing but `g` and the seed
//!   decides it.
//!
//! Damage never reaches a batch silently: weft's shards are checked block
//! by block (xxh3-64) the first time a block is read, every format's file
//! lengths are checked at open, and ids are checked against the
//! vocabulary as they are read.
//!
//! Packing and attention: sequences are cut from the concatenated
//! documents (end-of-text between them) without regard to document
//! boundaries — what GPT-2, nanoGPT and llm.c do. Nothing is wasted on
//! padding; by default a token may attend to the end of an unrelated
//! document before it, which the end-of-text token teaches the model to
//! discount. [`DataSpec::doc_mask`] asks the model to mask attention at
//! end-of-text instead ([`DataSpec::doc_boundary`] is the token).
//!
//! ```
//! use std::ops::ControlFlow;
//! use weft_data::{Corpus, Loader, PrepareOptions, prepare};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let text = dir.path().join("text");
//! std::fs::create_dir(&text).unwrap();
//! for i in 0..4 {
//!     let doc = format!("Document {i}. {}", "The quick brown fox jumps over the lazy dog. ".repeat(20));
//!     std::fs::write(text.join(format!("{i}.txt")), doc).unwrap();
//! }
//! let out = dir.path().join("prepared");
//! let report = prepare(&[text], &out, &PrepareOptions::default(), &mut |_| ControlFlow::Continue(())).unwrap();
//! assert_eq!(report.documents, 4);
//!
//! let corpus = Corpus::open(&out, 0.25).unwrap(); // the last document is validation
//! let loader = Loader::new(vec![(corpus, 1.0)], 16, 0).unwrap();
//! let mut seq = Vec::new();
//! loader.train_sequence(7, &mut seq).unwrap(); // sample 7 of the run
//! assert_eq!(seq.len(), 17);
//! ```

pub mod corpus;
pub mod dataset;
pub mod error;
pub mod format;
pub mod loader;
pub mod order;
pub mod prepare;
pub mod shard;
pub mod spec;
pub mod synthetic;
pub mod text;
pub mod tokenizer;

pub use corpus::{Corpus, END_OF_TEXT, Format, GPT2_VOCAB, LLAMA3_BEGIN_OF_TEXT, LLAMA3_VOCAB};
pub use dataset::{Batch, Dataset, DatasetOptions, SyntheticData, TokenData};
pub use error::{DataError, Result};
pub use format::{Index, Prepared};
pub use loader::{Loader, Part, Share};
pub use order::{Interleave, Permutation};
pub use prepare::{MAX_THREADS_PER_CORE, PrepareOptions, PrepareReport, Progress, prepare};
pub use shard::{Dtype, Shard, Stream};
pub use spec::{BlendEntry, DataSpec, DataSpecError, MIN_BLEND_SHARE, Source, TokenIds};
pub use synthetic::{SyntheticLanguage, SyntheticSpec};
pub use text::{TextData, cache_dir};
pub use tokenizer::{Tokenizer, TokenizerSpec};
