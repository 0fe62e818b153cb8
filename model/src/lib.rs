//! Decoder-only transformers built from `weft-kernels` ops — GPT-2 and
//! the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) in one block code
//! path — with the Hugging Face formats for weights.
//!
//! # Overview
//!
//! * [`GptConfig`]: n_layer, n_head, n_embd, vocab_size, block_size, tied
//!   embeddings, and the block's architecture [`BlockArch`]: GPT-2's
//!   ([`BlockArch::GPT2`]) or the options of the families pretrained
//!   today — grouped- and multi-query attention (`n_kv_head`), a head size
//!   set apart, RMSNorm ([`Norm`]), rotary positions ([`Positions`],
//!   [`Rotary`]: θ, partial rotary, Llama-3 scaling), biases on q/k/v
//!   and the output projection or not, QK-norm, sliding-window layers with
//!   every k-th layer global ([`SlidingWindow`]). The feed-forward block is
//!   chosen apart: [`Mlp`] (GPT-2's), [`SwiGlu`] (the gated MLP), or a
//!   mixture of experts. The Llama family is checked against transformers
//!   (`tests/it/llama_reference.rs`); with multi-head attention it runs
//!   every layout of the layout matrix (`tests/compose.rs`: data, FSDP,
//!   pipeline, tensor and sequence parallelism) and the [`Decoder`]
//!   decodes it bitwise (`tests/infer.rs`); grouped-query attention over
//!   `tp > 1` and the CUDA model take GPT-2 blocks only so far and refuse
//!   the others with an error.
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
//! * [`GptBlocks`]: the one block code path (embedding, blocks, head; each
//!   with its backward, or its input- and weight-gradient halves), which
//!   [`Gpt`], the pipeline stages and the sharded stages all run.
//!
//! # Parallelism as transforms
//!
//! Each parameter's placement on the tensor- and expert-parallel axes
//! comes with its layout ([`param_layout`], `weft_parallel::Placement`),
//! and the parallel axes are transforms of the one model:
//!
//! * [`tp`]: tensor parallelism as sharding styles of the block's linear
//!   layers (column-, row- and vocabulary-parallel; sequence parallelism);
//!   [`Gpt::shard_of`] is a rank's shard of a whole model.
//! * [`cp`]: context parallelism — each rank `T/cp` rows of every
//!   sequence, attention as a ring whose rows are bitwise the one-rank
//!   rows ([`GptBlocks::set_context_parallel`]).
//! * [`GptStage`]: a pipeline stage, an implementation of
//!   `weft_pipeline::Stage` (the tied embedding is a shared parameter);
//!   its parameters resident or fully sharded with `weft-fsdp`, whose
//!   hooks the block loop calls.
//! * [`ParallelGpt`]: the plan applied over a `weft_parallel::ParallelMesh`
//!   — tp sharding, pipeline stages, sequences over cp, replicas or FSDP —
//!   with one training step, evaluation, whole-model gather and load for
//!   every layout (what `weft train` runs on each rank). Example below.
//! * [`hf`]: load and save a Hugging Face folder (`config.json` +
//!   `model.safetensors`) of GPT-2 or of the Llama family (names and
//!   `[out, in]` layouts mapped); [`eval`]: the computation behind `weft
//!   eval`.
//! * [`Decoder`] ([`infer`]): the inference engine — incremental decoding
//!   with a key/value cache planned up front for `block_size` positions,
//!   whose logits are bitwise the training forward's for the same prefix
//!   (example below).
//!
//! Correctness is checked against PyTorch/transformers: `tests/` compares
//! the loss and every gradient with fixtures made by
//! `model/reference/make_fixtures.py` (GPT-2) and
//! `model/reference/make_llama_fixtures.py` (`LlamaForCausalLM`,
//! `Qwen3ForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`) and
//! `model/reference/make_qwen3moe_fixtures.py` (`Qwen3MoeForCausalLM`:
//! fine-grained SwiGLU experts, dense first layers), in f64, for several
//! small random configurations each.
//!
//! # Example
//!
//! ```
//! use weft_model::{Gpt, GptConfig};
//! use weft_kernels::AdamW;
//!
//! let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 50, block_size: 8,
//!                       tied_embeddings: true, layer_norm_epsilon: 1e-5, arch: weft_model::BlockArch::GPT2 };
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
//! # A parallel layout
//!
//! Two tensor-parallel ranks (threads) train the model of one rank, equal
//! to rounding:
//!
//! ```
//! use std::sync::Arc;
//! use weft_collectives::LocalCluster;
//! use weft_kernels::AdamW;
//! use weft_model::{tp::TpOptions, Gpt, GptConfig, Init, MicroBatch, Mlp, ParallelGpt, ParallelPlan};
//! use weft_parallel::ParallelDims;
//!
//! let cfg = GptConfig { n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 50, block_size: 8,
//!                       tied_embeddings: true, layer_norm_epsilon: 1e-5, arch: weft_model::BlockArch::GPT2 };
//! let mut whole = Gpt::new(cfg.clone())?;
//! whole.init_gpt2(1);
//! let tokens: Vec<u32> = (0..16).map(|i| i % 50).collect();
//! let targets: Vec<u32> = (1..17).map(|i| i % 50).collect();
//! let plan = ParallelPlan { fsdp: None, pipeline: None, batch: 2, seq: 8, micro_batches: 1,
//!                           reproducible: true, tp: TpOptions::default(),
//!                           precision: weft_kernels::Precision::F32,
//!                           grad_wire: weft_collectives::Dtype::F32,
//!                           doc_boundary: None, recompute: weft_model::Recompute::None,
//!                           loss_chunk: 0 };
//! let losses = |tp: usize| {
//!     LocalCluster::run(tp, |comm| {
//!         let mesh = ParallelDims { tp, ..ParallelDims::SINGLE }.build(&comm)?;
//!         let mut m = ParallelGpt::new(cfg.clone(), Arc::new(Mlp), Init::Whole(&whole.params), &plan, mesh)?;
//!         let mb = [MicroBatch { tokens: &tokens, targets: &targets }];
//!         (0..3)
//!             .map(|_| Ok(m.train_step(&mb, &AdamW::default(), 1.0)?.loss))
//!             .collect::<weft_model::Result<Vec<f64>>>()
//!     })
//! };
//! let (one, two) = (losses(1)?, losses(2)?);
//! for (a, b) in one[0].as_ref().unwrap().iter().zip(two[1].as_ref().unwrap()) {
//!     assert!((a - b).abs() < 1e-5 * a);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
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
//!                       tied_embeddings: true, layer_norm_epsilon: 1e-5, arch: weft_model::BlockArch::GPT2 };
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
//! * `cuda` (off by default): `cuda::CudaGpt`, the dense GPT trained on
//!   one GPU (forward, backward, AdamW on the device, the host layout),
//!   over `weft-kernels`' `cuda` backend; builds without a CUDA toolkit.
#![deny(missing_docs)]

mod blocks;
mod chunk;
mod config;
pub mod cp;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod eval;
mod ffn;
mod fsdp;
mod gpt;
pub mod hf;
pub mod infer;
mod init;
pub mod memory;
mod moe_ffn;
mod options;
pub mod parallelize;
mod params;
mod stage;
pub mod tp;
mod trainable;

pub use chunk::{HeadView, ParamStore, Piece};
pub use config::{BlockArch, GptConfig, Norm, Positions, Rotary, SlidingWindow};
pub use error::{Error, Result};
pub use ffn::{Dims, FeedForward, Mlp, ParamShape, SwiGlu, wide_input};
pub use gpt::{
    Activations, BlockActs, BlockScratch, Gpt, GptBlocks, HeadActs, MicroBatch, WeightInputs,
};
pub use infer::{Decoder, Sampling};
pub use init::init_gpt2;
pub use memory::RankMemory;
pub use moe_ffn::{MoeFfn, MoeStats};
pub use options::{Arch, ModelOptions};
pub use parallelize::{
    Init, ParallelGpt, ParallelPlan, StepOutcome, StepTraffic, expert_group, partition_layers,
};
pub use params::{
    BlockLayout, Sharding, dense_layout, is_muon_tensor, kv_copies, muon_matrices, param_layout,
};
pub use stage::{GptStage, OwnedPart, ReadTensor, StageSpec, pipeline_stages};
pub use trainable::{StepTelemetry, TrainModel, read_whole, whole_parts};
pub use weft_parallel::Recompute;
pub use weft_parallel::{AdamWState, ParamLayout, ParamSpec};
