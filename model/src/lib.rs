//! A GPT-2-style transformer built from `weft-kernels` ops, with the
//! Hugging Face GPT-2 format for weights.
//!
//! # Overview
//!
//! * [`GptConfig`]: n_layer, n_head, n_embd, vocab_size, block_size, tied
//!   embeddings.
//! * [`ParamLayout`] / [`ParamSpec`]: every parameter lives in one
//!   contiguous `Vec<f32>` ([`Gpt::params`]) under its Hugging Face name
//!   (`transformer.h.0.attn.c_attn.weight`, `Conv1D` `[in, out]` layout),
//!   a block's tensors contiguous, so the buffer shards cleanly for FSDP
//!   and tensor parallelism. Gradients ([`Gpt::grads`]) and AdamW moments
//!   ([`AdamWState`]) share the layout.
//! * [`Gpt`]: forward (logits and mean cross-entropy), backward (every
//!   parameter gradient), AdamW step. [`Activations`] are planned up front
//!   for a batch shape; [`Activations::bytes_per_token`] reports the cost.
//! * [`FeedForward`]: the extension point for the feed-forward block
//!   ([`Mlp`] is GPT-2's; a mixture of experts implements the same trait).
//! * [`hf`]: load and save a Hugging Face folder (`config.json` +
//!   `model.safetensors`); [`eval`]: the computation behind `weft eval`.
//! * [`Decoder`] ([`infer`]): the inference engine — incremental decoding
//!   with a key/value cache planned up front for `block_size` positions,
//!   whose logits are bitwise the training forward's for the same prefix
//!   (example below).
//!
//! Correctness is checked against PyTorch/transformers: `tests/` compares
//! the loss and every gradient with fixtures made by
//! `model/reference/make_fixtures.py` (f64 PyTorch), for several small
//! random configurations.
//!
//! # Example
//!
//! ```
//! use weft_model::{Gpt, GptConfig};
//! use weft_kernels::AdamW;
//!
//! let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 50, block_size: 8,
//!                       tied_embeddings: true, layer_norm_epsilon: 1e-5 };
//! let mut model = Gpt::new(cfg)?;
//! model.init_gpt2(42);
//! let mut acts = model.activations(2, 8)?; // B=2, T=8
//! let tokens: Vec<u32> = (0..16).map(|i| i % 50).collect();
//! let targets: Vec<u32> = (1..17).map(|i| i % 50).collect();
//! let mut opt = model.adamw_state();
//! let mut first = 0.0;
//! for step in 0..5 {
//!     let loss = model.forward(&mut acts, &tokens, Some(&targets))?.unwrap();
//!     if step == 0 { first = loss; }
//!     model.zero_grad();
//!     model.backward(&mut acts)?;
//!     model.adamw_step(&mut opt, &AdamW { lr: 1e-2, ..AdamW::default() })?;
//! }
//! let last = model.forward(&mut acts, &tokens, Some(&targets))?.unwrap();
//! assert!(last < first);
//! # Ok::<(), weft_model::Error>(())
//! ```
//!
//! # Inference
//!
//! Greedy decoding from a prompt with [`Decoder`]: the prompt is prefilled
//! in one pass, then each token costs one position's work.
//!
//! ```
//! use weft_model::{Decoder, Gpt, GptConfig};
//!
//! let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 50, block_size: 16,
//!                       tied_embeddings: true, layer_norm_epsilon: 1e-5 };
//! let mut model = Gpt::new(cfg)?;
//! model.init_gpt2(3);
//! let mut dec = Decoder::new(&model);
//! let argmax = |l: &[f32]| {
//!     (0..l.len()).fold(0, |best, i| if l[i] > l[best] { i } else { best }) as u32
//! };
//! let mut text = vec![1u32, 2, 3];
//! let mut next = argmax(dec.prefill(&text)?);
//! for _ in 0..10 {
//!     text.push(next);
//!     next = argmax(dec.step(next)?);
//! }
//! assert_eq!((text.len(), dec.len()), (13, 13));
//! println!("KV cache: {} bytes, decoder total {} bytes", dec.kv_bytes(), dec.bytes());
//! # Ok::<(), weft_model::Error>(())
//! ```
//!
//! # Crate features
//!
//! None. (CUDA lives behind `weft-kernels`' `cuda` feature.)
#![deny(missing_docs)]

mod config;
mod error;
pub mod eval;
mod ffn;
mod gpt;
pub mod hf;
pub mod infer;
mod moe_ffn;
mod params;
mod stage;
pub mod tp;

pub use config::GptConfig;
pub use error::{Error, Result};
pub use ffn::{Dims, FeedForward, Mlp, ParamShape};
pub use gpt::{
    Activations, BlockActs, BlockScratch, Gpt, GptBlocks, HeadActs, MicroBatch, WeightInputs,
};
pub use infer::Decoder;
pub use moe_ffn::{MoeFfn, MoeStats};
pub use params::{BlockLayout, Sharding, dense_layout, param_layout};
pub use stage::{GptStage, StageSpec, pipeline_stages};
pub use weft_parallel::{AdamWState, ParamLayout, ParamSpec};
