//! The weft trainer: the thin composer behind the `weft` command.
//!
//! The libraries own the math, the communication and the formats; this
//! crate turns a job configuration into a run. What is here so far:
//!
//! * [`config`]: the job configuration — TOML files plus `--set key=value`
//!   overrides, with errors that name the key, the file, the line and the
//!   expected type.
//! * [`synthetic`]: the built-in corpus, a seeded synthetic language whose
//!   loss floor (the Bayes-optimal cross-entropy) is known exactly.
//! * [`data`]: batches from that corpus or from text files tokenized with
//!   GPT-2's BPE (cached), as pure functions of (seed, step, micro-batch).
//! * [`schedule`]: linear warmup and cosine decay of the learning rate.
//! * [`train`]: the training loop and its run folder — one loop for every
//!   layout: the mesh from `[parallel]`, the model's parallelization plan
//!   (`weft_model::ParallelGpt`), and per step its micro-batches through
//!   the plan (data, sharded data, tensor, expert and pipeline
//!   parallelism; see `[parallel]` in [`config`]).
//! * `ranks`: the thread ranks of a run and rank 0's reports to the
//!   caller's observer.
//! * [`ckpt`]: periodic checkpoints (weft-checkpoint) and bit-for-bit resume.
//! * [`sample`]: `weft sample`, generation from a run's last checkpoint
//!   with the model's key/value-cache decoder.
//!
//! # Example
//! ```
//! use weft_trainer::config::Config;
//! use weft_trainer::synthetic::SyntheticLanguage;
//!
//! let config = Config::load(None, &["optim.lr=1e-3".to_string()])?;
//! assert_eq!(config.optim.lr, 1e-3);
//! let lang = SyntheticLanguage::new(config.data.synthetic.clone())?;
//! assert_eq!(lang.vocab_size(), 256);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Crate features
//! None yet.

#![deny(missing_docs)]

pub mod ckpt;
pub mod config;
pub mod data;
mod ranks;
pub mod sample;
pub mod schedule;
pub mod synthetic;
pub mod train;
