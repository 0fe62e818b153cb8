//! A GPT-2-style transformer built from `weft-kernels` ops.
//!
//! This crate will own the parameter layout (one allocation, HF GPT-2 names),
//! forward and backward passes for dense and mixture-of-experts blocks,
//! tensor-parallel layers and safetensors import/export.
//!
//! Nothing is implemented yet. See the kernels-and-model issue for the plan.
