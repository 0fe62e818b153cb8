//! The GPT-2 model: parameters, planned activations, forward, backward,
//! and the AdamW step.

use std::ops::Range;

use weft_kernels::{
    AdamW, Mode, adamw_update, attention_backward, attention_forward, encoder_backward,
    encoder_forward, fused_classifier, layernorm_backward, layernorm_forward, matmul_backward,
    matmul_backward_wt, matmul_forward, matmul_forward_wt, residual_forward,
};

use crate::config::GptConfig;
use crate::error::{Error, Result};
use crate::ffn::{Dims, FeedForward, Mlp};
use crate::params::ParamLayout;

/// Offsets of one block's tensors in the flat buffer.
#[derive(Clone, Debug)]
struct Block {
    ln1_w: Range<usize>,
    ln1_b: Range<usize>,
    qkv_w: Range<usize>,
    qkv_b: Range<usize>,
    proj_w: Range<usize>,
    proj_b: Range<usize>,
    ln2_w: Range<usize>,
    ln2_b: Range<usize>,
    ffn: Range<usize>,
}

/// A GPT-2-style transformer: configuration, the flat parameter and
/// gradient buffers (same [`ParamLayout`]), and the feed-forward block.
#[derive(Debug)]
pub struct Gpt {
    config: GptConfig,
    layout: ParamLayout,
    ffn: Box<dyn FeedForward>,
    blocks: Vec<Block>,
    mode: Mode,
    /// All parameters in one allocation, in [`ParamLayout`] order.
    pub params: Vec<f32>,
    /// Gradients, same layout; [`Gpt::backward`] accumulates into them.
    pub grads: Vec<f32>,
}

/// Activation buffers for one batch shape, allocated once up front.
///
/// Shapes (L layers, B batch, T sequence, C channels, NH heads, V vocab):
/// everything the backward needs is kept per layer; the backward's own
/// working buffers are one layer's worth, reused.
#[derive(Debug)]
pub struct Activations {
    b: usize,
    t: usize,
    tokens: Vec<u32>,  // (B,T)
    targets: Vec<u32>, // (B,T)
    has_targets: bool,
    encoded: Vec<f32>,     // (B,T,C)
    ln1: Vec<f32>,         // (L,B,T,C)
    ln1_mean: Vec<f32>,    // (L,B,T)
    ln1_rstd: Vec<f32>,    // (L,B,T)
    qkv: Vec<f32>,         // (L,B,T,3C)
    atty: Vec<f32>,        // (L,B,T,C)
    att: Vec<f32>,         // (L,B,NH,T,T)
    res2: Vec<f32>,        // (L,B,T,C)
    ln2: Vec<f32>,         // (L,B,T,C)
    ln2_mean: Vec<f32>,    // (L,B,T)
    ln2_rstd: Vec<f32>,    // (L,B,T)
    ffn_saved: Vec<f32>,   // (L,B,T,ffn.saved_per_token)
    res3: Vec<f32>,        // (L,B,T,C)
    lnf: Vec<f32>,         // (B,T,C)
    lnf_mean: Vec<f32>,    // (B,T)
    lnf_rstd: Vec<f32>,    // (B,T)
    logits: Vec<f32>,      // (B,T,V); holds dlogits after backward
    losses: Vec<f32>,      // (B,T)
    tmp: Vec<f32>,         // (B,T,C) block outputs before the residual add
    dres: Vec<f32>,        // (B,T,C) gradient of the residual stream
    dln: Vec<f32>,         // (B,T,C)
    datty: Vec<f32>,       // (B,T,C)
    dqkv: Vec<f32>,        // (B,T,3C)
    datt: Vec<f32>,        // (B,NH,T,T)
    ffn_scratch: Vec<f32>, // (B,T,ffn.scratch_per_token)
}

impl Activations {
    /// Batch size these buffers were planned for.
    pub fn batch(&self) -> usize {
        self.b
    }
    /// Sequence length these buffers were planned for.
    pub fn seq_len(&self) -> usize {
        self.t
    }
    /// Total bytes of all activation and backward buffers.
    pub fn bytes(&self) -> usize {
        let f = [
            &self.encoded,
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.atty,
            &self.att,
            &self.res2,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.ffn_saved,
            &self.res3,
            &self.lnf,
            &self.lnf_mean,
            &self.lnf_rstd,
            &self.logits,
            &self.losses,
            &self.tmp,
            &self.dres,
            &self.dln,
            &self.datty,
            &self.dqkv,
            &self.datt,
            &self.ffn_scratch,
        ];
        f.iter().map(|v| v.len()).sum::<usize>() * 4 + (self.tokens.len() + self.targets.len()) * 4
    }
    /// [`bytes`](Self::bytes) divided by the B·T tokens of the batch.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes() / (self.b * self.t).max(1)
    }
    /// Logits `(B,T,V)` of the last forward (after a backward they hold the
    /// logits' gradient instead).
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }
    /// Per-token losses `(B,T)` of the last forward with targets.
    pub fn losses(&self) -> &[f32] {
        &self.losses
    }
}

fn two_mut(buf: &mut [f32], a: Range<usize>, b: Range<usize>) -> (&mut [f32], &mut [f32]) {
    debug_assert!(a.end <= b.start);
    let (lo, hi) = buf.split_at_mut(b.start);
    (&mut lo[a], &mut hi[..b.end - b.start])
}

impl Gpt {
    /// A dense GPT-2 with all parameters zero (load or initialise them next).
    ///
    /// # Errors
    /// [`Error::Config`] if the configuration is inconsistent.
    pub fn new(config: GptConfig) -> Result<Self> {
        Self::with_ffn(config, Box::new(Mlp))
    }

    /// A GPT-2 whose blocks use a custom feed-forward block.
    ///
    /// # Errors
    /// [`Error::Config`] if the configuration is inconsistent.
    pub fn with_ffn(config: GptConfig, ffn: Box<dyn FeedForward>) -> Result<Self> {
        config.validate()?;
        let layout = ParamLayout::with_ffn(&config, ffn.as_ref());
        let blocks = (0..config.n_layer)
            .map(|l| {
                let r = |s: &str| layout.range(&format!("transformer.h.{l}.{s}"));
                let ffn_specs = ffn.params(config.n_embd);
                let first = r(&ffn_specs[0].suffix).start;
                let last = r(&ffn_specs[ffn_specs.len() - 1].suffix).end;
                Block {
                    ln1_w: r("ln_1.weight"),
                    ln1_b: r("ln_1.bias"),
                    qkv_w: r("attn.c_attn.weight"),
                    qkv_b: r("attn.c_attn.bias"),
                    proj_w: r("attn.c_proj.weight"),
                    proj_b: r("attn.c_proj.bias"),
                    ln2_w: r("ln_2.weight"),
                    ln2_b: r("ln_2.bias"),
                    ffn: first..last,
                }
            })
            .collect();
        let n = layout.len();
        Ok(Gpt {
            config,
            layout,
            ffn,
            blocks,
            mode: Mode::default(),
            params: vec![0.0; n],
            grads: vec![0.0; n],
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// The parameter layout (names, shapes, offsets).
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// How the forward's linear layers split their work (default:
    /// batch-invariant, so logits and per-token losses of a sequence are
    /// bitwise the same in any batch). The backward always runs whole-batch
    /// GEMMs: parameter gradients are sums over the batch anyway.
    pub fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// A named parameter tensor.
    pub fn param(&self, name: &str) -> Option<&[f32]> {
        self.layout.get(name).map(|s| &self.params[s.range()])
    }

    /// A named gradient tensor.
    pub fn grad(&self, name: &str) -> Option<&[f32]> {
        self.layout.get(name).map(|s| &self.grads[s.range()])
    }

    /// GPT-2's initialisation: N(0, 0.02) weights (the residual projections
    /// scaled by 1/sqrt(2L)), zero biases, unit layernorm gains. Uses a
    /// simple seeded generator (not PyTorch's stream).
    pub fn init_gpt2(&mut self, seed: u64) {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut normal = move || {
            // Box–Muller over xorshift64.
            let mut u = || {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                #[allow(clippy::cast_precision_loss)]
                let x = ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                x
            };
            let (a, b) = (u(), u());
            (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
        };
        #[allow(clippy::cast_precision_loss)]
        let proj_std = 0.02 / (2.0 * self.config.n_layer as f64).sqrt();
        for spec in self.layout.specs().to_vec() {
            let p = &mut self.params[spec.range()];
            if spec.shape.len() == 1 {
                let one = if spec.name.contains("ln_") { 1.0 } else { 0.0 };
                p.fill(one);
            } else {
                let std = if spec.name.ends_with("c_proj.weight") {
                    proj_std
                } else {
                    0.02
                };
                #[allow(clippy::cast_possible_truncation)]
                p.iter_mut().for_each(|x| *x = (normal() * std) as f32);
            }
        }
    }

    /// Plans (allocates) activation buffers for batches of `b` sequences of
    /// `t` tokens.
    ///
    /// # Errors
    /// [`Error::Batch`] if `t` exceeds the model's `block_size` or `b*t` is 0.
    pub fn activations(&self, b: usize, t: usize) -> Result<Activations> {
        if b == 0 || t == 0 || t > self.config.block_size {
            return Err(Error::Batch {
                reason: format!(
                    "B={b}, T={t}: need B >= 1 and 1 <= T <= block_size = {}",
                    self.config.block_size
                ),
            });
        }
        let GptConfig {
            n_layer: l,
            n_head: nh,
            n_embd: c,
            vocab_size: v,
            ..
        } = self.config;
        let n = b * t;
        let z = |k: usize| vec![0.0f32; k];
        Ok(Activations {
            b,
            t,
            tokens: vec![0; n],
            targets: vec![0; n],
            has_targets: false,
            encoded: z(n * c),
            ln1: z(l * n * c),
            ln1_mean: z(l * n),
            ln1_rstd: z(l * n),
            qkv: z(l * n * 3 * c),
            atty: z(l * n * c),
            att: z(l * b * nh * t * t),
            res2: z(l * n * c),
            ln2: z(l * n * c),
            ln2_mean: z(l * n),
            ln2_rstd: z(l * n),
            ffn_saved: z(l * n * self.ffn.saved_per_token(c)),
            res3: z(l * n * c),
            lnf: z(n * c),
            lnf_mean: z(n),
            lnf_rstd: z(n),
            logits: z(n * v),
            losses: z(n),
            tmp: z(n * c),
            dres: z(n * c),
            dln: z(n * c),
            datty: z(n * c),
            dqkv: z(n * 3 * c),
            datt: z(b * nh * t * t),
            ffn_scratch: z(n * self.ffn.scratch_per_token(c)),
        })
    }

    fn lm_head(&self) -> Range<usize> {
        let name = if self.config.tied_embeddings {
            "transformer.wte.weight"
        } else {
            "lm_head.weight"
        };
        self.layout.range(name)
    }

    /// Forward pass over `tokens (B,T)`. With `targets (B,T)` it also
    /// computes the per-token cross-entropy and returns the mean loss
    /// (accumulated in f64); without, it returns `None` and only the logits
    /// are meaningful.
    ///
    /// # Errors
    /// [`Error::Batch`] if `tokens`/`targets` do not hold B·T ids for the
    /// planned `acts`; a kernel error ([`weft_kernels::Error::TokenOutOfRange`])
    /// for an id outside the vocabulary.
    pub fn forward(
        &self,
        acts: &mut Activations,
        tokens: &[u32],
        targets: Option<&[u32]>,
    ) -> Result<Option<f64>> {
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        let GptConfig {
            n_head: nh,
            n_embd: c,
            vocab_size: v,
            layer_norm_epsilon: eps,
            ..
        } = self.config;
        if tokens.len() != n || targets.is_some_and(|x| x.len() != n) {
            return Err(Error::Batch {
                reason: format!(
                    "activations planned for B*T = {b}*{t} = {n} tokens, got {} inputs and {} targets",
                    tokens.len(),
                    targets.map_or(0, <[u32]>::len)
                ),
            });
        }
        acts.tokens.copy_from_slice(tokens);
        let p = &self.params;
        let mode = self.mode;
        encoder_forward(
            &mut acts.encoded,
            tokens,
            &p[self.layout.range("transformer.wte.weight")],
            &p[self.layout.range("transformer.wpe.weight")],
            b,
            t,
            c,
        )?;
        let d = Dims { b, t, c, mode };
        for (l, blk) in self.blocks.iter().enumerate() {
            let nc = n * c;
            let (prev, cur) = acts.res3.split_at_mut(l * nc);
            let res_in: &[f32] = if l == 0 {
                &acts.encoded
            } else {
                &prev[(l - 1) * nc..]
            };
            let ln1 = &mut acts.ln1[l * nc..(l + 1) * nc];
            layernorm_forward(
                ln1,
                &mut acts.ln1_mean[l * n..(l + 1) * n],
                &mut acts.ln1_rstd[l * n..(l + 1) * n],
                res_in,
                &p[blk.ln1_w.clone()],
                &p[blk.ln1_b.clone()],
                n,
                c,
                eps,
            )?;
            let qkv = &mut acts.qkv[l * 3 * nc..(l + 1) * 3 * nc];
            matmul_forward(
                qkv,
                ln1,
                &p[blk.qkv_w.clone()],
                Some(&p[blk.qkv_b.clone()]),
                b,
                t,
                c,
                3 * c,
                mode,
            )?;
            let atty = &mut acts.atty[l * nc..(l + 1) * nc];
            let att = &mut acts.att[l * b * nh * t * t..(l + 1) * b * nh * t * t];
            attention_forward(atty, att, qkv, b, t, c, nh)?;
            matmul_forward(
                &mut acts.tmp,
                atty,
                &p[blk.proj_w.clone()],
                Some(&p[blk.proj_b.clone()]),
                b,
                t,
                c,
                c,
                mode,
            )?;
            let res2 = &mut acts.res2[l * nc..(l + 1) * nc];
            residual_forward(res2, res_in, &acts.tmp, nc)?;
            let ln2 = &mut acts.ln2[l * nc..(l + 1) * nc];
            layernorm_forward(
                ln2,
                &mut acts.ln2_mean[l * n..(l + 1) * n],
                &mut acts.ln2_rstd[l * n..(l + 1) * n],
                res2,
                &p[blk.ln2_w.clone()],
                &p[blk.ln2_b.clone()],
                n,
                c,
                eps,
            )?;
            let fs = n * self.ffn.saved_per_token(c);
            let saved = &mut acts.ffn_saved[l * fs..(l + 1) * fs];
            self.ffn
                .forward(&mut acts.tmp, saved, ln2, &p[blk.ffn.clone()], d)?;
            residual_forward(&mut cur[..nc], res2, &acts.tmp, nc)?;
        }
        let last = &acts.res3[(self.config.n_layer - 1) * n * c..];
        layernorm_forward(
            &mut acts.lnf,
            &mut acts.lnf_mean,
            &mut acts.lnf_rstd,
            last,
            &p[self.layout.range("transformer.ln_f.weight")],
            &p[self.layout.range("transformer.ln_f.bias")],
            n,
            c,
            eps,
        )?;
        matmul_forward_wt(
            &mut acts.logits,
            &acts.lnf,
            &p[self.lm_head()],
            None,
            b,
            t,
            c,
            v,
            mode,
        )?;
        match targets {
            None => {
                acts.has_targets = false;
                Ok(None)
            }
            Some(tg) => {
                acts.targets.copy_from_slice(tg);
                acts.has_targets = true;
                fused_classifier(&mut acts.logits, &mut acts.losses, tg, None, n, v, v)?;
                let sum: f64 = acts.losses.iter().map(|&x| f64::from(x)).sum();
                #[allow(clippy::cast_precision_loss)]
                Ok(Some(sum / n as f64))
            }
        }
    }

    /// Sets every gradient to zero.
    pub fn zero_grad(&mut self) {
        self.grads.fill(0.0);
    }

    /// Backward pass of the mean loss of the last [`forward`](Self::forward)
    /// (which must have had targets), accumulating into
    /// [`grads`](Self::grads). Overwrites the logits with their gradient.
    ///
    /// # Errors
    /// [`Error::Batch`] if the last forward had no targets.
    pub fn backward(&mut self, acts: &mut Activations) -> Result<()> {
        if !acts.has_targets {
            return Err(Error::Batch {
                reason: "backward needs a forward with targets first".into(),
            });
        }
        acts.has_targets = false; // logits become dlogits below
        let (b, t) = (acts.b, acts.t);
        let n = b * t;
        let GptConfig {
            n_head: nh,
            n_embd: c,
            vocab_size: v,
            ..
        } = self.config;
        // Parameter gradients sum over the batch whatever the mode, and input
        // gradients need no invariance: whole-batch GEMMs are faster.
        let mode = Mode::Throughput;
        let d = Dims { b, t, c, mode };
        let nc = n * c;
        #[allow(clippy::cast_precision_loss)]
        let dloss = 1.0 / n as f32;
        fused_classifier(
            &mut acts.logits,
            &mut acts.losses,
            &acts.targets,
            Some(dloss),
            n,
            v,
            v,
        )?;
        let lm = self.lm_head();
        let p = &self.params;
        let g = &mut self.grads;
        acts.dln.fill(0.0);
        matmul_backward_wt(
            &mut acts.dln,
            &mut g[lm.clone()],
            None,
            &acts.logits,
            &acts.lnf,
            &p[lm],
            b,
            t,
            c,
            v,
            mode,
        )?;
        acts.dres.fill(0.0);
        let last = &acts.res3[(self.config.n_layer - 1) * nc..];
        let (lw, lb) = (
            self.layout.range("transformer.ln_f.weight"),
            self.layout.range("transformer.ln_f.bias"),
        );
        let (dlw, dlb) = two_mut(g, lw.clone(), lb);
        layernorm_backward(
            &mut acts.dres,
            dlw,
            dlb,
            &acts.dln,
            last,
            &p[lw],
            &acts.lnf_mean,
            &acts.lnf_rstd,
            n,
            c,
        )?;
        for (l, blk) in self.blocks.iter().enumerate().rev() {
            let res_in: &[f32] = if l == 0 {
                &acts.encoded
            } else {
                &acts.res3[(l - 1) * nc..l * nc]
            };
            let fs = n * self.ffn.saved_per_token(c);
            // Feed-forward block: dres is d(res3) = d(ffn out) and part of d(res2).
            acts.dln.fill(0.0);
            self.ffn.backward(
                &mut acts.dln,
                &mut g[blk.ffn.clone()],
                &mut acts.ffn_scratch,
                &acts.dres,
                &acts.ln2[l * nc..(l + 1) * nc],
                &acts.ffn_saved[l * fs..(l + 1) * fs],
                &p[blk.ffn.clone()],
                d,
            )?;
            let (dw, db) = two_mut(g, blk.ln2_w.clone(), blk.ln2_b.clone());
            layernorm_backward(
                &mut acts.dres,
                dw,
                db,
                &acts.dln,
                &acts.res2[l * nc..(l + 1) * nc],
                &p[blk.ln2_w.clone()],
                &acts.ln2_mean[l * n..(l + 1) * n],
                &acts.ln2_rstd[l * n..(l + 1) * n],
                n,
                c,
            )?;
            // Attention: dres is now d(res2) = d(attn proj out) and part of d(res_in).
            acts.datty.fill(0.0);
            let (dw, db) = two_mut(g, blk.proj_w.clone(), blk.proj_b.clone());
            matmul_backward(
                &mut acts.datty,
                dw,
                Some(db),
                &acts.dres,
                &acts.atty[l * nc..(l + 1) * nc],
                &p[blk.proj_w.clone()],
                b,
                t,
                c,
                c,
                mode,
            )?;
            acts.dqkv.fill(0.0);
            let att = &acts.att[l * b * nh * t * t..(l + 1) * b * nh * t * t];
            let qkv = &acts.qkv[l * 3 * nc..(l + 1) * 3 * nc];
            attention_backward(
                &mut acts.dqkv,
                &mut acts.datt,
                &acts.datty,
                qkv,
                att,
                b,
                t,
                c,
                nh,
            )?;
            acts.dln.fill(0.0);
            let (dw, db) = two_mut(g, blk.qkv_w.clone(), blk.qkv_b.clone());
            matmul_backward(
                &mut acts.dln,
                dw,
                Some(db),
                &acts.dqkv,
                &acts.ln1[l * nc..(l + 1) * nc],
                &p[blk.qkv_w.clone()],
                b,
                t,
                c,
                3 * c,
                mode,
            )?;
            let (dw, db) = two_mut(g, blk.ln1_w.clone(), blk.ln1_b.clone());
            layernorm_backward(
                &mut acts.dres,
                dw,
                db,
                &acts.dln,
                res_in,
                &p[blk.ln1_w.clone()],
                &acts.ln1_mean[l * n..(l + 1) * n],
                &acts.ln1_rstd[l * n..(l + 1) * n],
                n,
                c,
            )?;
        }
        let (we, pe) = (
            self.layout.range("transformer.wte.weight"),
            self.layout.range("transformer.wpe.weight"),
        );
        let (dwte, dwpe) = two_mut(g, we, pe);
        encoder_backward(dwte, dwpe, &acts.dres, &acts.tokens, b, t, c)?;
        Ok(())
    }

    /// One AdamW step over every parameter, decaying those whose
    /// [`ParamSpec::decay`](crate::ParamSpec::decay) is set. `state` holds
    /// the moments (create it with [`AdamWState::new`]).
    ///
    /// # Errors
    /// A kernel error if `state` was made for another model size.
    pub fn adamw_step(&mut self, state: &mut AdamWState, hp: &AdamW) -> Result<()> {
        state.step += 1;
        for spec in self.layout.specs() {
            let r = spec.range();
            adamw_update(
                &mut self.params[r.clone()],
                &self.grads[r.clone()],
                &mut state.m[r.clone()],
                &mut state.v[r],
                hp,
                state.step,
                spec.decay,
            )?;
        }
        Ok(())
    }
}

/// AdamW moments for a [`Gpt`] (same layout as its parameters).
#[derive(Clone, Debug)]
pub struct AdamWState {
    /// First moments.
    pub m: Vec<f32>,
    /// Second moments.
    pub v: Vec<f32>,
    /// Steps taken so far.
    pub step: u32,
}

impl AdamWState {
    /// Zero moments for `model`.
    pub fn new(model: &Gpt) -> Self {
        AdamWState {
            m: vec![0.0; model.params.len()],
            v: vec![0.0; model.params.len()],
            step: 0,
        }
    }
}
