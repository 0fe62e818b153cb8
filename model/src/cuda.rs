//! The dense GPT on one GPU (feature `cuda`): forward, backward and AdamW
//! on the device, with the host model's parameter layout.
//!
//! [`CudaGpt`] mirrors [`Gpt`] (GPT-2's dense MLP block, no
//! parallelism: one GPU, `dp = 1`): the parameters, their gradients and
//! the AdamW moments are [`DeviceParams`] with the host [`ParamLayout`]'s
//! names and ranges, so [`CudaGpt::params`] downloads exactly the buffer
//! that [`Gpt::params`] holds, and a checkpoint, an
//! export or a comparison reads it as it reads the host model's. Each op
//! is the GPU twin of the CPU op the host model calls, in the same order
//! (llm.c's `train_gpt2.cu` shape): the two models' losses agree to the
//! rounding the GPU ops document (the gpu-check compares them step by
//! step).
//!
//! What the trainer's GPU loop (`weft train` with `train.device =
//! "cuda"`) calls: [`CudaGpt::train_step_batches`] — gradient
//! accumulation over micro-batches ([`CudaGpt::backward_accumulate`]),
//! the exact global norm, clipping and the non-finite skip, as
//! `ParallelGpt`'s step on one rank — [`CudaGpt::eval_loss`] (forward
//! only, any number of sequences up to `B`), the AdamW state
//! ([`CudaGpt::optimizer_state`], [`CudaGpt::set_optimizer_state`]) for
//! checkpoints, and [`CudaGpt::predict_memory`] to refuse a model the GPU
//! cannot hold before allocating it. Not yet run on a GPU: compiled and
//! linted in CI; `model/tests/cuda.rs` checks it against the CPU model on
//! a GPU machine.
//!
//! [`ParamLayout`]: weft_parallel::ParamLayout

use weft_kernels::cuda::{self, CudaSlice, DeviceParams, Gpu, GpuAdamW, TensorSpec};
use weft_kernels::{AdamW, Mode, Precision};
use weft_parallel::AdamWState;

use crate::config::GptConfig;
use crate::error::{Error, Result};
use crate::gpt::{Gpt, MicroBatch};
use crate::memory::RankMemory;
use crate::parallelize::StepOutcome;

/// One block's saved activations, `N = B·T` rows.
struct LayerActs {
    ln1: CudaSlice<f32>,      // (N, C)
    ln1_mean: CudaSlice<f32>, // (N)
    ln1_rstd: CudaSlice<f32>, // (N)
    qkv: CudaSlice<f32>,      // (N, 3C)
    atty: CudaSlice<f32>,     // (N, C)
    lse: CudaSlice<f32>,      // (B, NH, T)
    res2: CudaSlice<f32>,     // (N, C) residual after attention
    ln2: CudaSlice<f32>,      // (N, C)
    ln2_mean: CudaSlice<f32>, // (N)
    ln2_rstd: CudaSlice<f32>, // (N)
    fch: CudaSlice<f32>,      // (N, 4C)
    fch_gelu: CudaSlice<f32>, // (N, 4C)
    out: CudaSlice<f32>,      // (N, C) the block's output
}

impl LayerActs {
    /// Floats held.
    fn floats(&self) -> usize {
        [
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.atty,
            &self.lse,
            &self.res2,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &self.fch_gelu,
            &self.out,
        ]
        .iter()
        .map(|b| b.len())
        .sum()
    }
}

/// Backward working buffers, one layer's worth, reused.
struct Scratch {
    dres: CudaSlice<f32>,  // (N, C) gradient of the residual stream
    dln: CudaSlice<f32>,   // (N, C)
    datty: CudaSlice<f32>, // (N, C)
    dqkv: CudaSlice<f32>,  // (N, 3C)
    dfch: CudaSlice<f32>,  // (N, 4C)
    dgelu: CudaSlice<f32>, // (N, 4C)
    tmp: CudaSlice<f32>,   // (N, C)
    dw: CudaSlice<f32>,    // (C) a layernorm's weight gradient
    db: CudaSlice<f32>,    // (C) a layernorm's bias gradient
    dwpe: CudaSlice<f32>,  // (maxT, C)
}

impl Scratch {
    /// Floats held.
    fn floats(&self) -> usize {
        [
            &self.dres,
            &self.dln,
            &self.datty,
            &self.dqkv,
            &self.dfch,
            &self.dgelu,
            &self.tmp,
            &self.dw,
            &self.db,
            &self.dwpe,
        ]
        .iter()
        .map(|b| b.len())
        .sum()
    }
}

/// Floats of the activations and working buffers [`CudaGpt::new`]
/// allocates for batches of `b × t` tokens (what [`CudaGpt::memory`]
/// counts from the buffers once they exist).
fn activation_floats(config: &GptConfig, b: usize, t: usize) -> usize {
    let (n, c, nh, v) = (b * t, config.n_embd, config.n_head, config.vocab_size);
    // per layer: ln1, qkv, atty, res2, ln2, fch, fch_gelu, out; the
    // layernorms' statistics; attention's log-sum-exp
    let layer = n * c * (1 + 3 + 1 + 1 + 1 + 4 + 4 + 1) + 4 * n + n * nh;
    // backward scratch: dres, dln, datty, dqkv, dfch, dgelu, tmp; dw, db;
    // dwpe
    let scratch = n * c * (1 + 1 + 1 + 3 + 4 + 4 + 1) + 2 * c + config.block_size * c;
    // encoded, lnf and its statistics, logits, losses, the classifier's
    // statistics
    let rest = 2 * n * c + 2 * n + n * v + n + 2 * n;
    config.n_layer * layer + scratch + rest
}

/// Values of the largest 16-bit cuBLAS product's two rounded operands,
/// `k · (m + n)` (the sum is the same for a product and its transpose),
/// over the forward and both backward products of every linear layer and
/// the tied head for batches of `b × t` tokens: what [`CudaGpt::new`]
/// reserves ([`Gpu::reserve_operands`]) in bf16 and fp16.
fn operand_values(config: &GptConfig, b: usize, t: usize) -> usize {
    let (n, c, v) = (b * t, config.n_embd, config.vocab_size);
    let mut linears = vec![(c, v)];
    if config.n_layer > 0 {
        linears.extend([(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)]);
    }
    linears
        .into_iter()
        // forward (k = in), input gradient (k = out), weight gradient
        // (k = the tokens)
        .flat_map(|(i, o)| [i * (n + o), o * (n + i), n * (i + o)])
        .max()
        .unwrap_or(0)
}

/// The dense GPT-2 on one GPU, planned for batches of `B` sequences of `T`
/// tokens.
pub struct CudaGpt {
    gpu: Gpu,
    config: GptConfig,
    layout: weft_parallel::ParamLayout,
    params: DeviceParams,
    grads: DeviceParams,
    opt: GpuAdamW,
    b: usize,
    t: usize,
    mode: Mode,
    precision: Precision,
    encoded: CudaSlice<f32>, // (N, C)
    layers: Vec<LayerActs>,
    lnf: CudaSlice<f32>,      // (N, C)
    lnf_mean: CudaSlice<f32>, // (N)
    lnf_rstd: CudaSlice<f32>, // (N)
    logits: CudaSlice<f32>,   // (N, V); their gradient after backward
    losses: CudaSlice<f32>,   // (N)
    stats: CudaSlice<f32>,    // (N, 2)
    scratch: Scratch,
    tokens: Vec<u32>,
    targets: Option<Vec<u32>>,
}

impl std::fmt::Debug for CudaGpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGpt")
            .field("gpu", &self.gpu)
            .field("config", &self.config)
            .field("b", &self.b)
            .field("t", &self.t)
            .field("precision", &self.precision)
            .finish_non_exhaustive()
    }
}

impl CudaGpt {
    /// Copies `model`'s parameters to `gpu` and plans activations for
    /// batches of `b × t` tokens, with zero gradients and AdamW moments.
    /// The products run in `precision` (bf16 mixed precision is the
    /// device's usual choice), cuBLAS ([`Mode::Throughput`]) or the
    /// batch-invariant kernel.
    ///
    /// # Errors
    /// [`Error::Config`] for a model with another feed-forward block than
    /// GPT-2's MLP, or sharded (tensor-parallel); [`Error::Batch`] for
    /// `t` over the block size or an empty batch; a kernel error
    /// ([`weft_kernels::Error::Cuda`]) if an allocation fails.
    pub fn new(
        gpu: Gpu,
        model: &Gpt,
        b: usize,
        t: usize,
        hp: AdamW,
        mode: Mode,
        precision: Precision,
    ) -> Result<Self> {
        let config = model.config().clone();
        if model.blocks().tp().is_some() {
            return Err(Error::Config {
                field: "parallel.tp",
                reason: "the CUDA model runs one whole model on one GPU (tp = 1)".into(),
            });
        }
        if config.arch != crate::BlockArch::GPT2 {
            return Err(Error::Config {
                field: "arch",
                reason: "the CUDA model runs GPT-2 blocks only".into(),
            });
        }
        if b * t == 0 || t > config.block_size {
            return Err(Error::Batch {
                reason: format!(
                    "batch {b} x {t} tokens: need at least one token and T <= block_size = {}",
                    config.block_size
                ),
            });
        }
        let layout = model.layout();
        let tensors: Vec<TensorSpec> = layout
            .specs()
            .iter()
            .map(|s| TensorSpec {
                name: s.name.clone(),
                range: s.range(),
                decay: s.decay,
            })
            .collect();
        // GPT-2's MLP and nothing else: the names the block code reads.
        let mlp = "transformer.h.0.mlp.c_fc.weight";
        if config.n_layer > 0 && layout.get(mlp).is_none() {
            return Err(Error::Config {
                field: "model.ffn",
                reason: "the CUDA model implements GPT-2's dense MLP block only".into(),
            });
        }
        if precision != Precision::F32 {
            gpu.reserve_operands(operand_values(&config, b, t))?;
        }
        let params = DeviceParams::upload(&gpu, &model.params, tensors)?;
        let grads = DeviceParams::zeros_like(&gpu, &params)?;
        let opt = GpuAdamW::new(&gpu, &params, hp)?;
        let (n, c, nh, v) = (b * t, config.n_embd, config.n_head, config.vocab_size);
        let z = |len: usize| gpu.zeros::<f32>(len);
        let mut layers = Vec::with_capacity(config.n_layer);
        for _ in 0..config.n_layer {
            layers.push(LayerActs {
                ln1: z(n * c)?,
                ln1_mean: z(n)?,
                ln1_rstd: z(n)?,
                qkv: z(n * 3 * c)?,
                atty: z(n * c)?,
                lse: z(b * nh * t)?,
                res2: z(n * c)?,
                ln2: z(n * c)?,
                ln2_mean: z(n)?,
                ln2_rstd: z(n)?,
                fch: z(n * 4 * c)?,
                fch_gelu: z(n * 4 * c)?,
                out: z(n * c)?,
            });
        }
        let scratch = Scratch {
            dres: z(n * c)?,
            dln: z(n * c)?,
            datty: z(n * c)?,
            dqkv: z(n * 3 * c)?,
            dfch: z(n * 4 * c)?,
            dgelu: z(n * 4 * c)?,
            tmp: z(n * c)?,
            dw: z(c)?,
            db: z(c)?,
            dwpe: z(config.block_size * c)?,
        };
        Ok(Self {
            encoded: z(n * c)?,
            lnf: z(n * c)?,
            lnf_mean: z(n)?,
            lnf_rstd: z(n)?,
            logits: z(n * v)?,
            losses: z(n)?,
            stats: z(2 * n)?,
            layers,
            scratch,
            gpu,
            config,
            layout: layout.clone(),
            params,
            grads,
            opt,
            b,
            t,
            mode,
            precision,
            tokens: Vec::new(),
            targets: None,
        })
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The parameters, downloaded: the host model's buffer layout.
    ///
    /// # Errors
    /// A kernel error if the copy fails.
    pub fn params(&self) -> Result<Vec<f32>> {
        Ok(self.params.download(&self.gpu)?)
    }

    /// Parameter tensor `name`, downloaded.
    ///
    /// # Errors
    /// A kernel error for an unknown name or if the copy fails.
    pub fn read_param(&self, name: &str) -> Result<Vec<f32>> {
        Ok(self.params.read(&self.gpu, name)?)
    }

    /// Overwrites parameter tensor `name` with `values` (its length), in
    /// stream order: the next step computes with them.
    ///
    /// # Errors
    /// A kernel error for an unknown name, a wrong length or a failed
    /// copy.
    pub fn write_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        Ok(self.params.write(&self.gpu, name, values)?)
    }

    /// The gradients of the last [`backward`](Self::backward), downloaded.
    ///
    /// # Errors
    /// A kernel error if the copy fails.
    pub fn grads(&self) -> Result<Vec<f32>> {
        Ok(self.grads.download(&self.gpu)?)
    }

    /// The AdamW moments and step count, downloaded: the host layout's
    /// buffers, as [`Gpt::adamw_step`]'s state holds them (and a checkpoint
    /// saves them).
    ///
    /// # Errors
    /// A kernel error if a copy fails.
    pub fn optimizer_state(&self) -> Result<AdamWState> {
        let (m, v) = self.opt.moments();
        Ok(AdamWState {
            m: m.download(&self.gpu)?,
            v: v.download(&self.gpu)?,
            step: self.opt.steps(),
        })
    }

    /// Replaces the AdamW moments and step count with `state` (a
    /// checkpoint's, or a host model's), to continue from it.
    ///
    /// # Errors
    /// A kernel error ([`weft_kernels::Error::ShapeMismatch`]) if `state`
    /// was made for another model size; a copy error.
    pub fn set_optimizer_state(&mut self, state: &AdamWState) -> Result<()> {
        self.opt
            .set_state(&self.gpu, &state.m, &state.v, state.step)?;
        Ok(())
    }

    /// The device memory `model` needs on the GPU for batches of `b × t`
    /// tokens with its products in `precision`, before anything is
    /// allocated: f32 parameters, gradients and two AdamW moments (16 bytes
    /// per parameter), and the activations and working buffers (f32), with,
    /// in bf16 and fp16, the buffer of the cuBLAS products' rounded
    /// operands (2 bytes per value of the largest product's two operands;
    /// for GPT-2's head, the logits' gradient and the embedding).
    pub fn predict_memory(model: &Gpt, b: usize, t: usize, precision: Precision) -> RankMemory {
        let p = 4 * model.layout().len();
        let operands = if precision == Precision::F32 {
            0
        } else {
            2 * operand_values(model.config(), b, t)
        };
        RankMemory {
            params: p,
            grads: p,
            optimizer: 2 * p,
            activations: 4 * activation_floats(model.config(), b, t) + operands,
            comm: 0,
        }
    }

    /// The device memory held, counted from the buffers (as
    /// [`predict_memory`](Self::predict_memory) predicts it).
    pub fn memory(&self) -> RankMemory {
        let p = 4 * self.params.len();
        let acts = self.layers.iter().map(LayerActs::floats).sum::<usize>()
            + self.scratch.floats()
            + [
                &self.encoded,
                &self.lnf,
                &self.lnf_mean,
                &self.lnf_rstd,
                &self.logits,
                &self.losses,
                &self.stats,
            ]
            .iter()
            .map(|b| b.len())
            .sum::<usize>();
        RankMemory {
            params: p,
            grads: 4 * self.grads.len(),
            optimizer: 2 * p,
            activations: 4 * acts + self.gpu.operand_bytes(),
            comm: 0,
        }
    }

    /// Forward over `tokens (B,T)`; with `targets` returns the mean
    /// cross-entropy (summed in f64 on the host, as the CPU model does).
    ///
    /// # Errors
    /// [`Error::Batch`] for token arrays of the wrong length; kernel errors.
    pub fn forward(&mut self, tokens: &[u32], targets: Option<&[u32]>) -> Result<Option<f64>> {
        let (b, t) = (self.b, self.t);
        let n = b * t;
        if tokens.len() != n || targets.is_some_and(|tg| tg.len() != n) {
            return Err(Error::Batch {
                reason: format!("expected {n} tokens (and targets) for B={b}, T={t}"),
            });
        }
        let GptConfig {
            n_embd: c,
            n_head: nh,
            vocab_size: v,
            layer_norm_epsilon: eps,
            ..
        } = self.config;
        let (g, mode, prec) = (&self.gpu, self.mode, self.precision);
        cuda::encoder_forward(
            g,
            &mut self.encoded,
            tokens,
            None,
            &self.params.view("transformer.wte.weight")?,
            &self.params.view("transformer.wpe.weight")?,
            b,
            t,
            c,
        )?;
        for l in 0..self.config.n_layer {
            let pre = format!("transformer.h.{l}.");
            let p = |s: &str| self.params.view(&format!("{pre}{s}"));
            let (done, rest) = self.layers.split_at_mut(l);
            let a = &mut rest[0];
            let inp = if l == 0 {
                &self.encoded
            } else {
                &done[l - 1].out
            };
            cuda::layernorm_forward(
                g,
                &mut a.ln1,
                &mut a.ln1_mean,
                &mut a.ln1_rstd,
                inp,
                &p("ln_1.weight")?,
                &p("ln_1.bias")?,
                n,
                c,
                eps,
            )?;
            cuda::matmul_forward(
                g,
                &mut a.qkv,
                &a.ln1,
                &p("attn.c_attn.weight")?,
                Some(&p("attn.c_attn.bias")?),
                n,
                c,
                3 * c,
                mode,
                prec,
            )?;
            cuda::attention_forward(g, &mut a.atty, &mut a.lse, &a.qkv, None, b, t, c, nh)?;
            let tmp = &mut self.scratch.tmp;
            cuda::matmul_forward(
                g,
                tmp,
                &a.atty,
                &p("attn.c_proj.weight")?,
                Some(&p("attn.c_proj.bias")?),
                n,
                c,
                c,
                mode,
                prec,
            )?;
            cuda::residual_forward(g, &mut a.res2, inp, tmp, n * c)?;
            cuda::layernorm_forward(
                g,
                &mut a.ln2,
                &mut a.ln2_mean,
                &mut a.ln2_rstd,
                &a.res2,
                &p("ln_2.weight")?,
                &p("ln_2.bias")?,
                n,
                c,
                eps,
            )?;
            cuda::matmul_forward(
                g,
                &mut a.fch,
                &a.ln2,
                &p("mlp.c_fc.weight")?,
                Some(&p("mlp.c_fc.bias")?),
                n,
                c,
                4 * c,
                mode,
                prec,
            )?;
            cuda::gelu_forward(g, &mut a.fch_gelu, &a.fch, n * 4 * c)?;
            cuda::matmul_forward(
                g,
                tmp,
                &a.fch_gelu,
                &p("mlp.c_proj.weight")?,
                Some(&p("mlp.c_proj.bias")?),
                n,
                4 * c,
                c,
                mode,
                prec,
            )?;
            cuda::residual_forward(g, &mut a.out, &a.res2, tmp, n * c)?;
        }
        let last = match self.layers.last() {
            Some(a) => &a.out,
            None => &self.encoded,
        };
        cuda::layernorm_forward(
            g,
            &mut self.lnf,
            &mut self.lnf_mean,
            &mut self.lnf_rstd,
            last,
            &self.params.view("transformer.ln_f.weight")?,
            &self.params.view("transformer.ln_f.bias")?,
            n,
            c,
            eps,
        )?;
        let head = self.lm_head_name();
        cuda::matmul_forward_wt(
            g,
            &mut self.logits,
            &self.lnf,
            &self.params.view(head)?,
            None,
            n,
            c,
            v,
            mode,
            prec,
        )?;
        self.tokens = tokens.to_vec();
        let Some(tg) = targets else {
            self.targets = None;
            return Ok(None);
        };
        cuda::fused_classifier_forward(
            g,
            &self.logits,
            &mut self.losses,
            &mut self.stats,
            tg,
            n,
            v,
            v,
        )?;
        self.targets = Some(tg.to_vec());
        self.mean_loss(n).map(Some)
    }

    /// The mean of the first `tokens` per-token losses of the last forward
    /// with targets, summed in f64 on the host (as the CPU model does).
    fn mean_loss(&self, tokens: usize) -> Result<f64> {
        let losses = self.gpu.download(&self.losses)?;
        let sum: f64 = losses[..tokens.min(losses.len())]
            .iter()
            .map(|&x| f64::from(x))
            .sum();
        #[allow(clippy::cast_precision_loss)]
        Ok(sum / tokens as f64)
    }

    /// The mean validation loss of `batches` (each of at most `B`
    /// sequences of `T` tokens: a shorter one is padded with copies of its
    /// first sequence, whose losses are left out — every sequence is
    /// computed on its own), forward only: each batch's mean weighted by
    /// its tokens, as `ParallelGpt::eval_loss` weights them. No backward
    /// can follow.
    ///
    /// # Errors
    /// [`Error::Batch`] for a batch that is empty, longer than `B`
    /// sequences, not whole sequences, or whose targets differ in length;
    /// kernel errors.
    pub fn eval_loss(&mut self, batches: &[MicroBatch<'_>]) -> Result<f64> {
        let (b, t) = (self.b, self.t);
        let (mut total, mut tokens) = (0.0f64, 0usize);
        let (mut tok, mut tgt) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for mb in batches {
            let n = mb.tokens.len();
            if n == 0 || n > b * t || n % t != 0 || mb.targets.len() != n {
                self.targets = None;
                return Err(Error::Batch {
                    reason: format!(
                        "an evaluation batch of {n} tokens ({} targets): expected whole sequences of T={t}, at most B={b} of them",
                        mb.targets.len()
                    ),
                });
            }
            tok.clear();
            tgt.clear();
            tok.extend_from_slice(mb.tokens);
            tgt.extend_from_slice(mb.targets);
            while tok.len() < b * t {
                tok.extend_from_slice(&mb.tokens[..t]);
                tgt.extend_from_slice(&mb.targets[..t]);
            }
            let done = self.forward(&tok, Some(&tgt));
            self.targets = None;
            done?;
            #[allow(clippy::cast_precision_loss)]
            let weight = n as f64;
            total += self.mean_loss(n)? * weight;
            tokens += n;
        }
        #[allow(clippy::cast_precision_loss)]
        Ok(total / tokens.max(1) as f64)
    }

    fn lm_head_name(&self) -> &'static str {
        if self.config.tied_embeddings {
            "transformer.wte.weight"
        } else {
            "lm_head.weight"
        }
    }

    /// Backward of the mean loss of the last [`forward`](Self::forward)
    /// (which must have had targets): the gradients are *set* (zeroed
    /// first), then accumulated op by op in the CPU model's order.
    ///
    /// # Errors
    /// [`Error::Batch`] if the last forward had no targets; kernel errors.
    pub fn backward(&mut self) -> Result<()> {
        if self.targets.is_none() {
            return Err(Error::Batch {
                reason: "backward needs a forward with targets first".into(),
            });
        }
        self.zero_grads()?;
        self.backward_accumulate(1.0)
    }

    /// Sets every gradient to zero.
    ///
    /// # Errors
    /// Kernel errors.
    pub fn zero_grads(&mut self) -> Result<()> {
        cuda::zero(&self.gpu, self.grads.all_mut())?;
        Ok(())
    }

    /// Backward of `weight ×` the mean loss of the last
    /// [`forward`](Self::forward) (which must have had targets), *added*
    /// to the gradients op by op in the CPU model's order: gradient
    /// accumulation over micro-batches ([`zero_grads`](Self::zero_grads)
    /// first). A `weight` other than 1 scales the loss (a loss scale).
    ///
    /// # Errors
    /// [`Error::Batch`] if the last forward had no targets; kernel errors.
    pub fn backward_accumulate(&mut self, weight: f32) -> Result<()> {
        let Some(targets) = self.targets.take() else {
            return Err(Error::Batch {
                reason: "backward needs a forward with targets first".into(),
            });
        };
        let (b, t) = (self.b, self.t);
        let n = b * t;
        let GptConfig {
            n_embd: c,
            n_head: nh,
            vocab_size: v,
            ..
        } = self.config;
        let (g, prec, mode) = (&self.gpu, self.precision, self.mode);
        let (params, grads) = (&self.params, &mut self.grads);
        let s = &mut self.scratch;
        #[allow(clippy::cast_precision_loss)]
        let dloss = weight / n as f32;
        cuda::fused_classifier_backward(
            g,
            &mut self.logits,
            &self.stats,
            &targets,
            dloss,
            n,
            v,
            v,
        )?;
        // The head (as the CPU: Mode::Throughput): dlnf = dlogits · W,
        // dW += dlogitsᵀ · lnf.
        let head = if self.config.tied_embeddings {
            "transformer.wte.weight"
        } else {
            "lm_head.weight"
        };
        cuda::zero(g, &mut s.dln)?;
        cuda::matmul_backward_wt_input(
            g,
            &mut s.dln,
            &self.logits,
            &params.view(head)?,
            n,
            c,
            v,
            Mode::Throughput,
            prec,
        )?;
        cuda::matmul_backward_wt_weight(
            g,
            &mut grads.view_mut(head)?,
            None,
            &self.logits,
            &self.lnf,
            n,
            c,
            v,
            Mode::Throughput,
            prec,
        )?;
        let last = match self.layers.last() {
            Some(a) => &a.out,
            None => &self.encoded,
        };
        cuda::zero(g, &mut s.dres)?;
        ln_backward(
            g,
            grads,
            params,
            s,
            "transformer.ln_f.",
            last,
            &self.lnf_mean,
            &self.lnf_rstd,
            n,
            c,
        )?;
        for l in (0..self.config.n_layer).rev() {
            let pre = format!("transformer.h.{l}.");
            let name = |x: &str| format!("{pre}{x}");
            let a = &self.layers[l];
            let inp = if l == 0 {
                &self.encoded
            } else {
                &self.layers[l - 1].out
            };
            // MLP: out = res2 + proj(gelu(fc(ln2(res2)))).
            cuda::zero(g, &mut s.dgelu)?;
            cuda::matmul_backward_input(
                g,
                &mut s.dgelu,
                &s.dres,
                &params.view(&name("mlp.c_proj.weight"))?,
                n,
                4 * c,
                c,
                mode,
                prec,
            )?;
            linear_weight(
                g,
                grads,
                &name("mlp.c_proj."),
                &s.dres,
                &a.fch_gelu,
                n,
                4 * c,
                c,
                mode,
                prec,
            )?;
            cuda::zero(g, &mut s.dfch)?;
            cuda::gelu_backward(g, &mut s.dfch, &a.fch, &s.dgelu, n * 4 * c)?;
            cuda::zero(g, &mut s.dln)?;
            cuda::matmul_backward_input(
                g,
                &mut s.dln,
                &s.dfch,
                &params.view(&name("mlp.c_fc.weight"))?,
                n,
                c,
                4 * c,
                mode,
                prec,
            )?;
            linear_weight(
                g,
                grads,
                &name("mlp.c_fc."),
                &s.dfch,
                &a.ln2,
                n,
                c,
                4 * c,
                mode,
                prec,
            )?;
            // dres becomes d(res2): dres + ln_2's input gradient.
            ln_backward(
                g,
                grads,
                params,
                s,
                &name("ln_2."),
                &a.res2,
                &a.ln2_mean,
                &a.ln2_rstd,
                n,
                c,
            )?;
            // Attention: res2 = inp + proj(attn(qkv(ln1(inp)))).
            cuda::zero(g, &mut s.datty)?;
            cuda::matmul_backward_input(
                g,
                &mut s.datty,
                &s.dres,
                &params.view(&name("attn.c_proj.weight"))?,
                n,
                c,
                c,
                mode,
                prec,
            )?;
            linear_weight(
                g,
                grads,
                &name("attn.c_proj."),
                &s.dres,
                &a.atty,
                n,
                c,
                c,
                mode,
                prec,
            )?;
            cuda::zero(g, &mut s.dqkv)?;
            cuda::attention_backward(
                g,
                &mut s.dqkv,
                &s.datty,
                &a.qkv,
                &a.atty,
                &a.lse,
                None,
                b,
                t,
                c,
                nh,
            )?;
            cuda::zero(g, &mut s.dln)?;
            cuda::matmul_backward_input(
                g,
                &mut s.dln,
                &s.dqkv,
                &params.view(&name("attn.c_attn.weight"))?,
                n,
                c,
                3 * c,
                mode,
                prec,
            )?;
            linear_weight(
                g,
                grads,
                &name("attn.c_attn."),
                &s.dqkv,
                &a.ln1,
                n,
                c,
                3 * c,
                mode,
                prec,
            )?;
            // dres becomes d(inp): d(res2) + ln_1's input gradient.
            ln_backward(
                g,
                grads,
                params,
                s,
                &name("ln_1."),
                inp,
                &a.ln1_mean,
                &a.ln1_rstd,
                n,
                c,
            )?;
        }
        // The embedding: dwte (after the tied head's part) and dwpe, the
        // latter through a zeroed scratch (0 + x is exact) since both are
        // views of one buffer.
        cuda::zero(g, &mut s.dwpe)?;
        cuda::encoder_backward(
            g,
            &mut grads.view_mut("transformer.wte.weight")?,
            &mut s.dwpe,
            &s.dres,
            &self.tokens,
            None,
            b,
            t,
            c,
        )?;
        cuda::accumulate(g, &mut grads.view_mut("transformer.wpe.weight")?, &s.dwpe)?;
        Ok(())
    }

    /// One AdamW step from the gradients of the last backward (the host
    /// model's decay flags; no clipping, as [`Gpt::adamw_step`]).
    ///
    /// # Errors
    /// Kernel errors.
    pub fn adamw_step(&mut self, hp: &AdamW) -> Result<()> {
        self.opt.hp = *hp;
        self.opt
            .step(&self.gpu, &mut self.params, self.grads.all())?;
        Ok(())
    }

    /// The global norm of the gradients, `√Σg²` with the squares summed
    /// exactly (`cuda::exact_sum_squares`) and rounded once: the CPU's
    /// `weft_parallel::GradNorm` of the same values, bit for bit.
    ///
    /// # Errors
    /// Kernel errors.
    pub fn grad_norm(&self) -> Result<f64> {
        Ok(cuda::exact_sum_squares(&self.gpu, self.grads.all())?
            .to_f64()
            .sqrt())
    }

    /// Multiplies every gradient by `a`.
    ///
    /// # Errors
    /// Kernel errors.
    pub fn scale_grads(&mut self, a: f32) -> Result<()> {
        cuda::scale(&self.gpu, self.grads.all_mut(), a)?;
        Ok(())
    }

    /// One optimizer step over the micro-batches `batches` (each `B × T`),
    /// as `ParallelGpt::train_step` takes it on one rank: the gradients
    /// of every micro-batch's mean loss accumulated, divided by their
    /// number; the exact global norm; a non-finite loss or norm skips the
    /// update (the gradients are dropped), else the gradients are clipped
    /// to norm `clip` (0: off; coefficient `clip / (norm + 1e-6)`, as the
    /// CPU's) and AdamW steps. The loss is the micro-batches' mean (summed
    /// in f64 in order); the norm is the one before clipping.
    ///
    /// The micro-batch gradients are summed in f32 on the device (the
    /// CPU's reproducible mode sums them exactly): equal to rounding.
    ///
    /// # Errors
    /// [`Error::Batch`] for no micro-batch or one of the wrong size;
    /// kernel errors.
    pub fn train_step_batches(
        &mut self,
        batches: &[MicroBatch<'_>],
        hp: &AdamW,
        clip: f64,
    ) -> Result<StepOutcome> {
        if batches.is_empty() {
            return Err(Error::Batch {
                reason: "a training step needs at least one micro-batch".into(),
            });
        }
        self.zero_grads()?;
        let mut loss = 0.0;
        for mb in batches {
            loss += self
                .forward(mb.tokens, Some(mb.targets))?
                .unwrap_or(f64::NAN);
            self.backward_accumulate(1.0)?;
        }
        let m = batches.len();
        #[allow(clippy::cast_precision_loss)]
        let loss = loss / m as f64;
        if m > 1 {
            #[allow(clippy::cast_precision_loss)]
            self.scale_grads(1.0 / m as f32)?;
        }
        let grad_norm = self.grad_norm()?;
        let applied = loss.is_finite() && grad_norm.is_finite();
        if applied {
            if clip > 0.0 && grad_norm > clip {
                #[allow(clippy::cast_possible_truncation)]
                self.scale_grads((clip / (grad_norm + 1e-6)) as f32)?;
            }
            self.adamw_step(hp)?;
        } else {
            self.zero_grads()?;
        }
        Ok(StepOutcome {
            loss,
            grad_norm,
            applied,
        })
    }

    /// Forward with targets, backward, AdamW: one training step; returns
    /// the loss before the update.
    ///
    /// # Errors
    /// As [`forward`](Self::forward) and [`backward`](Self::backward).
    pub fn train_step(&mut self, tokens: &[u32], targets: &[u32], hp: &AdamW) -> Result<f64> {
        let loss = self.forward(tokens, Some(targets))?.unwrap_or(f64::NAN);
        self.backward()?;
        self.adamw_step(hp)?;
        Ok(loss)
    }
}

/// `dW += inpᵀ · dout` and `db += Σ dout` of linear layer `pre`
/// (`{pre}weight`, `{pre}bias`), one after the other.
#[allow(clippy::too_many_arguments)]
fn linear_weight(
    g: &Gpu,
    grads: &mut DeviceParams,
    pre: &str,
    dout: &CudaSlice<f32>,
    inp: &CudaSlice<f32>,
    n: usize,
    c: usize,
    oc: usize,
    mode: Mode,
    prec: Precision,
) -> Result<()> {
    cuda::matmul_backward_weight(
        g,
        &mut grads.view_mut(&format!("{pre}weight"))?,
        None,
        dout,
        inp,
        n,
        c,
        oc,
        mode,
        prec,
    )?;
    cuda::bias_backward(g, &mut grads.view_mut(&format!("{pre}bias"))?, dout, n, oc)?;
    Ok(())
}

/// Layernorm `pre`'s backward: `s.dres += ` its input gradient (from
/// `s.dln`), then its weight and bias gradients through zeroed scratch
/// (each tensor gets one contribution per step, so `0 + x` then `+=` is
/// exact).
#[allow(clippy::too_many_arguments)]
fn ln_backward(
    g: &Gpu,
    grads: &mut DeviceParams,
    params: &DeviceParams,
    s: &mut Scratch,
    pre: &str,
    inp: &CudaSlice<f32>,
    mean: &CudaSlice<f32>,
    rstd: &CudaSlice<f32>,
    n: usize,
    c: usize,
) -> Result<()> {
    let w = params.view(&format!("{pre}weight"))?;
    cuda::layernorm_backward_input(g, &mut s.dres, &s.dln, inp, &w, mean, rstd, n, c)?;
    cuda::zero(g, &mut s.dw)?;
    cuda::zero(g, &mut s.db)?;
    cuda::layernorm_backward_weight(g, &mut s.dw, &mut s.db, &s.dln, inp, mean, rstd, n, c)?;
    cuda::accumulate(g, &mut grads.view_mut(&format!("{pre}weight"))?, &s.dw)?;
    cuda::accumulate(g, &mut grads.view_mut(&format!("{pre}bias"))?, &s.db)?;
    Ok(())
}

/// The GPU model in the training loop: one rank holding the whole model
/// (its checkpoint parts are every tensor, downloaded; loading uploads
/// them), no loss scaling on the device (the trainer refuses fp16 there).
impl crate::TrainModel for CudaGpt {
    fn train_step(
        &mut self,
        batches: &[MicroBatch<'_>],
        hp: &weft_kernels::OptimStep,
        clip: f64,
        loss_scale: f32,
    ) -> Result<StepOutcome> {
        if hp.muon.is_some() {
            return Err(Error::Config {
                field: "optim.name",
                reason: "the GPU model trains with AdamW only".into(),
            });
        }
        let hp = &hp.adamw;
        if loss_scale != 1.0 {
            return Err(Error::Config {
                field: "loss_scale",
                reason: format!("= {loss_scale}: the GPU model has no dynamic loss scaling"),
            });
        }
        self.train_step_batches(batches, hp, clip)
    }

    fn eval_loss(&mut self, batches: &[MicroBatch<'_>]) -> Result<f64> {
        CudaGpt::eval_loss(self, batches)
    }

    fn whole_layout(&self) -> &weft_parallel::ParamLayout {
        &self.layout
    }

    fn read_param(&self, name: &str) -> Result<Option<Vec<f32>>> {
        CudaGpt::read_param(self, name).map(Some)
    }

    fn write_param(&mut self, name: &str, values: &[f32]) -> Result<bool> {
        CudaGpt::write_param(self, name, values).map(|()| true)
    }

    fn owned_parts(&self) -> Result<(Vec<crate::OwnedPart>, u32)> {
        let opt = self.optimizer_state()?;
        Ok((
            crate::whole_parts(&self.layout, &self.params()?, &opt),
            opt.step,
        ))
    }

    fn load_with(&mut self, step: u32, read: &mut crate::ReadTensor<'_>) -> Result<()> {
        let mut params = vec![0.0; self.layout.len()];
        let mut opt = AdamWState::zeros(self.layout.len());
        crate::read_whole(&self.layout, &mut params, &mut opt, step, read)?;
        let layout = self.layout.clone();
        for spec in layout.specs() {
            CudaGpt::write_param(self, &spec.name, &params[spec.range()])?;
        }
        self.set_optimizer_state(&opt)
    }

    fn memory(&self) -> RankMemory {
        CudaGpt::memory(self)
    }

    fn finish_step(&mut self) -> Result<()> {
        Ok(self.gpu.synchronize()?)
    }
}
