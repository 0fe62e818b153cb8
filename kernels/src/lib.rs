//! The math of one device.
//!
//! This crate will own forward and backward kernels for matmul, layernorm,
//! GELU, causal self-attention, softmax, cross-entropy, embeddings and the
//! AdamW update, written as plain functions over slices with explicit shapes
//! (in the spirit of llm.c), multi-threaded and SIMD on the CPU by default,
//! with CUDA kernels behind a `cuda` feature, and a batch-invariant mode.
//!
//! Nothing is implemented yet. See the kernels-and-model issue for the plan.
