//! The math of one device: forward and backward kernels for GPT-2- and
//! Llama-style transformers, on the CPU (multi-threaded, SIMD), and on CUDA GPUs
//! (feature `cuda`).
//!
//! # Overview
//!
//! Every op is a pair of plain functions over slices with explicit shapes,
//! in the spirit of llm.c: arguments go outputs, inputs, weights, then
//! dimensions (B batch, T sequence, C channels, OC output channels, NH
//! heads, V vocabulary); a forward saves what its backward needs (layernorm
//! saves `mean` and `rstd`, attention each row's log-sum-exp); a backward
//! *accumulates* (`+=`) into gradient buffers. The caller owns every
//! activation and gradient buffer, so the hot path allocates nothing of its
//! own (the GEMM library keeps a per-thread packing buffer). Each function
//! checks its buffers' lengths first and returns [`Error::ShapeMismatch`]
//! naming the op and the argument instead of panicking.
//!
//! | op | forward | backward |
//! |---|---|---|
//! | linear (`[in, out]` weight, optional bias) | [`matmul_forward`] | [`matmul_backward`] = [`matmul_backward_input`] + [`matmul_backward_weight`] |
//! | linear (`[out, in]` weight, e.g. a tied `lm_head`) | [`matmul_forward_wt`] | [`matmul_backward_wt`] = [`matmul_backward_wt_input`] + [`matmul_backward_wt_weight`] |
//! | layernorm | [`layernorm_forward`] | [`layernorm_backward`] = [`layernorm_backward_input`] + [`layernorm_backward_weight`] |
//! | RMSNorm (Llama, Qwen; QK-norm per head) | [`rmsnorm_forward`] | [`rmsnorm_backward`] = [`rmsnorm_backward_input`] + [`rmsnorm_backward_weight`] |
//! | GELU, tanh approximation | [`gelu_forward`] | [`gelu_backward`] |
//! | SwiGLU gate, `silu(gate) ⊙ up` | [`swiglu_forward`] | [`swiglu_backward`] |
//! | rotary positions ([`Rope`]: θ, partial rotary, Llama-3 scaling), in place | [`rope_forward`] | [`rope_backward`] |
//! | causal multi-head or grouped-query ([`Heads`]) attention, optionally masked at document boundaries ([`doc_starts`]) or to a sliding window ([`window_starts`]), flash-style (no `T×T` buffer) | [`attention_forward`] (one position from a key/value cache: [`attention_decode`]) | [`attention_backward`] |
//! | the same by chunks of keys, for context parallelism: a chunk's partials, merged in position order into the bits of the whole | [`attention_partial`], [`attention_merge`] | [`attention_backward_partial`], [`attention_grad_merge`] |
//! | softmax | [`softmax_forward`] | [`softmax_backward`] |
//! | cross-entropy | [`crossentropy_forward`] | [`crossentropy_softmax_backward`] |
//! | softmax + cross-entropy, fused, in place | [`fused_classifier`] | (same call) |
//! | the same, the backward in one pass from saved row statistics | [`fused_classifier_forward`] | [`fused_classifier_backward`] |
//! | token + position embedding | [`encoder_forward`] | [`encoder_backward`] |
//! | residual add | [`residual_forward`] | [`residual_backward`] |
//! | AdamW update | [`adamw_update`] with [`AdamW`] | |
//! | a run's optimizer (AdamW, or Muon for the hidden matrices and AdamW for the rest) and each step's hyper-parameters | [`OptimConfig::step_at`] → [`OptimStep`] | |
//! | Muon update (momentum, Newton–Schulz orthogonalisation, scaled step; torch's `Muon`) | [`muon_update`] with [`Muon`] = [`muon_momentum`] + [`newton_schulz`] + [`muon_apply`] | |
//! | learning-rate schedule: linear warmup, then cosine, linear, constant or warmup-stable-decay ([`Schedule`], [`DecayShape`]; checked against PyTorch's schedulers) | [`LrSchedule::lr_at`] (a job's `[optim]`: [`OptimConfig::lr_at`]) | |
//!
//! Mixed precision: every linear layer's products take a [`Precision`].
//! [`Precision::Bf16`] rounds their operands to bf16 as they are packed
//! and accumulates in f32 (`vdpbf16ps` where the CPU has AVX512-BF16, else
//! widened to f32), batch invariant like the f32 GEMM; [`matmul_bf16`] is
//! the same product on bf16 buffers. [`bf16_dot_peak_gflops`] measures the
//! bf16 peak it is held against, and `benches/bf16_gemm.rs` compares it
//! with the f32 GEMM at GPT-2 small's layers. On an Intel Xeon with AMX
//! and on an AMD EPYC with AVX512-BF16 and no AMX, the bf16 products beat
//! the f32 GEMM and take at most what PyTorch's bf16 GEMM takes, and
//! GPT-2 small's bf16 training step (`weft-model`'s `train_step` bench)
//! beats its f32 step and PyTorch's autocast-bf16 step; the measured
//! figures are in the repository's `benchmarks/` records
//! `2026-12-05-bf16-gemm-amx.md`, `2026-12-05-bf16-gemm-epyc.md`,
//! `2026-12-05-bf16-step-amx.md` and `2026-12-05-bf16-step-epyc.md`.
//! [`Precision::F16`] rounds the operands to fp16 (bit for bit the f32
//! kernels on pre-rounded operands; no fp16 products on these CPUs).
//!
//! All kernels are generic over [`Real`] (`f32` or `f64`). Training uses
//! `f32`; the tests run the same code in `f64` and compare every backward
//! with central finite differences.
//!
//! GEMMs go to the `gemm` crate (AVX-512 kernels selected at run time, split
//! over the rayon pool). Attention has its own AVX-512 register tiles over
//! the causal part only, parallel over (sequence, head), with a portable
//! version for `f64` and other CPUs. Element-wise and row-wise loops are
//! compiled for AVX-512, AVX2 and baseline and dispatched at run time,
//! split over rayon. [`zero`] clears large gradient and scratch buffers
//! over the pool, and [`fma_peak_gflops`] measures the cores' f32 peak, the
//! denominator of the benches' "percent of peak".
//!
//! # Batch invariance
//!
//! [`Mode::BatchInvariant`] (the default) makes every per-sequence result
//! bitwise identical whether the sequence is computed alone or anywhere in
//! a batch of any size: the forward of a linear layer gives every output
//! row bits that depend on its input row alone (the GEMM library never
//! splits the reduction dimension across threads, and the matmul module
//! keeps every call on one kernel path with a fixed reduction blocking),
//! so it runs one GEMM over the whole batch in either mode; attention is
//! per (sequence, head), and row-wise ops are per row. The modes differ in
//! the input-gradient GEMMs ([`matmul_backward_input`]): one per sequence
//! in [`Mode::BatchInvariant`], one over the batch in [`Mode::Throughput`].
//!
//! # Example
//!
//! ```
//! use weft_kernels::{Mode, Precision, gelu_forward, matmul_forward};
//!
//! // out (B=1, T=2, OC=3) = inp (1, 2, C=2) · weight (2, 3) + bias (3)
//! let inp = [1.0f32, 2.0, 3.0, 4.0];
//! let weight = [1.0f32, 0.0, 1.0, 0.0, 1.0, 1.0];
//! let bias = [0.5f32, 0.5, 0.5];
//! let mut out = [0.0f32; 6];
//! let (mode, f32) = (Mode::BatchInvariant, Precision::F32);
//! matmul_forward(&mut out, &inp, &weight, Some(&bias), 1, 2, 2, 3, mode, f32)?;
//! assert_eq!(out, [1.5, 2.5, 3.5, 3.5, 4.5, 7.5]);
//!
//! // The same in bf16 mixed precision (these values are exact in bf16).
//! let mut mixed = [0.0f32; 6];
//! matmul_forward(&mut mixed, &inp, &weight, Some(&bias), 1, 2, 2, 3, mode, Precision::Bf16)?;
//! assert_eq!(mixed, out);
//!
//! let mut act = [0.0f32; 6];
//! gelu_forward(&mut act, &out, 6)?;
//! assert!((act[0] - 1.3996).abs() < 1e-3);
//!
//! // A wrong length is an error naming the op and the buffer.
//! let err = gelu_forward(&mut act, &out[..5], 6).unwrap_err();
//! assert_eq!(err.to_string(), "gelu_forward: buffer `inp` has 5 elements, expected 6");
//! # Ok::<(), weft_kernels::Error>(())
//! ```
//!
//! # Crate features
//!
//! * `cuda` (off by default): the CUDA backend, [`cuda`]: the ops above
//!   on device buffers (NVRTC-compiled kernels from `kernels/cuda/*.cu`,
//!   cuBLAS products, a flash-style attention, exact sums), a device
//!   parameter store with the host layout, and fused AdamW. It builds
//!   without a CUDA toolkit (cudarc loads the driver, NVRTC and cuBLAS at
//!   run time) and reports a missing library or device as
//!   [`Error::Unavailable`] rather than panicking; without the feature,
//!   [`cuda::device_count`] returns [`Error::NotCompiled`]. Each GPU op is
//!   tested against the CPU op of the same name (`tests/cuda.rs`), and
//!   every kernel source is compiled for `sm_80` and `sm_90` by a test that
//!   needs only libnvrtc; `scripts/gpu-check.sh` runs the GPU side.
//! * `serde` (off by default): [`Precision`] (de)serializes as `"fp32"`,
//!   `"bf16"` or `"fp16"`, the names a job file uses.
//!   [`OptimConfig`] (de)serializes as a job's `[optim]` table, its
//!   [`Optimizer`], [`Schedule`] and [`DecayShape`] by their lowercase
//!   names, [`MuonScale`] as `"original"` or `"match_rms_adamw"`.
#![deny(missing_docs)]

mod adamw;
mod attention;
pub mod cuda;
mod embedding;
mod error;
mod fp16;
mod gemm;
mod gemm_bf16;
mod held;
mod layernorm;
mod matmul;
mod muon;
mod optim;
mod peak;
mod pointwise;
mod real;
mod rmsnorm;
mod rope;
mod schedule;
mod simd;
mod softmax;
#[cfg(test)]
mod testutil;

pub use adamw::{AdamW, adamw_update};
pub use attention::{
    Heads, Span, attention_backward, attention_backward_partial, attention_decode,
    attention_forward, attention_grad_merge, attention_merge, attention_partial,
    attention_partial_len, doc_starts, window_starts,
};
pub use embedding::{check_tokens, encoder_backward, encoder_forward};
pub use error::{Error, Result};
pub use gemm_bf16::{
    Bf16Path, bf16_dot_peak_gflops, bf16_path, matmul_bf16, round_to_bf16_for_products,
};
pub use held::operand_copy_bytes;
pub use layernorm::{
    layernorm_backward, layernorm_backward_input, layernorm_backward_weight, layernorm_forward,
};
pub use matmul::{
    LinearInput, WT_SUM_ROWS, matmul_backward, matmul_backward_input, matmul_backward_weight,
    matmul_backward_wt, matmul_backward_wt_input, matmul_backward_wt_weight, matmul_forward,
    matmul_forward_wt,
};
pub use muon::{
    Muon, MuonScale, WeightShape, muon_apply, muon_momentum, muon_update, newton_schulz,
};
pub use optim::{OptimConfig, OptimStep, Optimizer};
pub use peak::fma_peak_gflops;
pub use pointwise::{
    gelu_backward, gelu_forward, residual_backward, residual_forward, swiglu_backward,
    swiglu_forward,
};
pub use real::{Real, exp_f32, tanh_f32};
pub use rmsnorm::{
    rmsnorm_backward, rmsnorm_backward_input, rmsnorm_backward_weight, rmsnorm_forward,
};
pub use rope::{Llama3Scaling, Rope, RopeTable, rope_backward, rope_forward};
pub use schedule::{DecayShape, LrSchedule, Schedule};
pub use softmax::{
    crossentropy_forward, crossentropy_softmax_backward, fused_classifier,
    fused_classifier_backward, fused_classifier_forward, softmax_backward, softmax_forward,
};

/// How linear layers split their work (see the crate docs on batch
/// invariance).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Each sequence's result is bitwise identical whatever batch it is
    /// computed in (input-gradient GEMMs run one per sequence).
    #[default]
    BatchInvariant,
    /// Input-gradient GEMMs run one per batch: those results may differ in
    /// the last bits between batch sizes (forwards are the same as in
    /// [`Mode::BatchInvariant`]).
    Throughput,
}

/// The arithmetic of the linear layers' matrix products
/// ([`matmul_forward`] and its backward halves, the `_wt` ones too).
///
/// Buffers stay in `f32` (or `f64`) whatever the precision: what changes
/// is what the products multiply. (A caller may keep a layer's input in
/// bf16 itself — [`LinearInput::Bf16`], rounded by
/// [`round_to_bf16_for_products`] — which in `Bf16` gives the same bits
/// in half the bytes.) Everything else — biases, layernorm,
/// GELU, attention, softmax and the loss, the gradients' sums across
/// micro-batches — is computed in the buffers' precision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Precision {
    /// Products of the buffers' values, in their precision.
    #[default]
    #[cfg_attr(feature = "serde", serde(rename = "fp32"))]
    F32,
    /// Mixed precision: every operand of a product is rounded to the
    /// nearest bf16 (ties to even) as the GEMM packs it, and the products
    /// are accumulated in `f32` — the arithmetic of bf16 tensor cores and
    /// of `torch.autocast(dtype=torch.bfloat16)` matrix products, on
    /// `vdpbf16ps` where the CPU has AVX512-BF16 (twice the f32 FMA rate;
    /// see [`matmul_bf16`]). Rows stay batch invariant in both [`Mode`]s.
    /// With `f64` buffers the rounded operands are multiplied in `f64`.
    /// On AVX512-BF16 f32 operands are rounded as they are packed, so no
    /// copy of them is made (the packed blocks, about 1.25 MiB per
    /// thread, are kept for the next product); on AMX likewise (up to
    /// 2 MiB per thread, and a left operand of up to 16 MiB packed whole
    /// on the calling thread). Only an operand strided both ways goes
    /// through a rounded row-major copy, kept per calling thread. The
    /// model's memory report does not count them ([`operand_copy_bytes`]
    /// measures them).
    #[cfg_attr(feature = "serde", serde(rename = "bf16"))]
    Bf16,
    /// Mixed precision with fp16 operands: every operand of a product is
    /// rounded to the nearest IEEE half (ties to even, subnormals kept,
    /// overflow to infinity) and the products are accumulated in `f32` —
    /// the arithmetic of fp16 tensor cores with f32 accumulation. Bit for
    /// bit the [`F32`](Self::F32) kernels run on operands rounded to fp16
    /// beforehand, so every batch-invariance property of `F32` holds. No
    /// CPU of this project's kind multiplies fp16 natively: this is
    /// `F32`'s speed (plus a rounding pass per operand), for checking an
    /// fp16 recipe — its range (largest value 65504, gradients below
    /// 2⁻²⁴ lost: train with dynamic loss scaling) — before spending
    /// accelerators on it. The rounded `f32` copies of both operands are
    /// kept per thread for the next product (not counted by the model's
    /// memory report; [`operand_copy_bytes`] measures them).
    #[cfg_attr(feature = "serde", serde(rename = "fp16"))]
    F16,
}

impl Precision {
    /// The name used in configs and reports: `"fp32"`, `"bf16"` or
    /// `"fp16"`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "fp16",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = Error;

    /// Parses `fp32` (or `f32`), `bf16`, `fp16` (or `f16`).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fp32" | "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" | "f16" => Ok(Precision::F16),
            _ => Err(Error::InvalidArgument {
                op: "precision",
                reason: format!("`{s}` is not one of fp32, bf16, fp16"),
            }),
        }
    }
}

/// `dst += src` element-wise, in parallel (for merging gradient buffers).
///
/// # Errors
/// [`Error::ShapeMismatch`] if the lengths differ.
pub fn accumulate<T: Real>(dst: &mut [T], src: &[T]) -> Result<()> {
    error::check("accumulate", "src", src, dst.len())?;
    pointwise::accumulate(dst, src);
    Ok(())
}

/// Sets every element of `buf` to zero, over the thread pool for large
/// buffers (one core's stores reach about half the memory bandwidth of
/// two): for gradient buffers and the scratch that backward kernels
/// accumulate into.
///
/// ```
/// let mut g = vec![1.0f32; 1 << 20];
/// weft_kernels::zero(&mut g);
/// assert!(g.iter().all(|&x| x == 0.0));
/// ```
pub fn zero<T: Real>(buf: &mut [T]) {
    pointwise::zero(buf);
}
