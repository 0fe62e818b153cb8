//! The mixture-of-experts feed-forward block ([`weft_moe::MoeBlock`]) as
//! a [`FeedForward`].
//!
//! Its tensors live under `transformer.h.{l}.mlp.` (`router.weight`,
//! `router.selection_bias`, `experts.c_fc.weight (E,C,H)`, ...). The
//! selection bias is never decayed and its gradient is always 0, so AdamW
//! leaves it alone; the trainer sets it with
//! [`weft_moe::BiasBalancer::update`] after each step from the load that
//! [`MoeStats::take`] returns. Each forward (one per layer, in layer
//! order) appends its [`weft_moe::MoeForward`] (load statistics and the
//! auxiliary loss value) to the shared log behind [`MoeStats`].
//!
//! The experts run grouped over the whole batch, so the block is not
//! batch-invariant whatever [`Dims::mode`] says.

use std::sync::{Arc, Mutex};

use weft_moe::{MoeBlock, MoeConfig, MoeForward};

use crate::error::{Error, Result};
use crate::ffn::{Dims, FeedForward, ParamShape};

/// A mixture-of-experts block implementing [`FeedForward`].
#[derive(Debug)]
pub struct MoeFfn {
    block: MoeBlock,
    log: Arc<Mutex<Vec<MoeForward>>>,
}

/// The trainer's handle on the statistics every [`MoeFfn`] forward logs.
#[derive(Clone, Debug)]
pub struct MoeStats(Arc<Mutex<Vec<MoeForward>>>);

impl MoeStats {
    /// Takes the logged forwards, oldest first (one per MoE layer per
    /// forward pass, in layer order).
    pub fn take(&self) -> Vec<MoeForward> {
        std::mem::take(
            &mut *self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

fn moe_err(e: weft_moe::Error) -> Error {
    match e {
        weft_moe::Error::Kernel(k) => Error::Kernel(k),
        other => Error::Config {
            field: "model.moe",
            reason: other.to_string(),
        },
    }
}

impl MoeFfn {
    /// A block with configuration `cfg` (its `channels` must equal the
    /// model's `n_embd`) and the handle on its statistics.
    ///
    /// # Errors
    /// [`Error::Config`] if the MoE configuration is invalid.
    pub fn new(cfg: MoeConfig) -> Result<(Self, MoeStats)> {
        let block = MoeBlock::new(cfg).map_err(moe_err)?;
        let log = Arc::new(Mutex::new(Vec::new()));
        Ok((
            MoeFfn {
                block,
                log: Arc::clone(&log),
            },
            MoeStats(log),
        ))
    }

    /// The MoE configuration.
    pub fn config(&self) -> &MoeConfig {
        self.block.config()
    }

    fn check(&self, d: Dims) -> Result<Vec<usize>> {
        let c = self.block.config().channels;
        if d.c != c {
            return Err(Error::Config {
                field: "model.moe",
                reason: format!("built for {c} channels but the model has {}", d.c),
            });
        }
        Ok(vec![d.t; d.b])
    }
}

impl FeedForward for MoeFfn {
    fn params(&self, _c: usize) -> Vec<ParamShape> {
        let cfg = self.block.config();
        cfg.tensors(cfg.router.experts)
            .into_iter()
            .map(|t| ParamShape {
                suffix: format!("mlp.{}", t.name),
                shape: t.shape,
                decay: t.decay,
            })
            .collect()
    }

    fn saved_per_token(&self, _c: usize) -> usize {
        self.block.config().saved_per_token()
    }

    fn scratch_per_token(&self, _c: usize) -> usize {
        0 // the block allocates its own grouped buffers
    }

    fn forward(
        &self,
        out: &mut [f32],
        saved: &mut [f32],
        inp: &[f32],
        params: &[f32],
        d: Dims,
    ) -> Result<()> {
        let lens = self.check(d)?;
        let f = self
            .block
            .forward(out, saved, inp, params, &lens)
            .map_err(moe_err)?;
        self.log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(f);
        Ok(())
    }

    fn backward(
        &self,
        dinp: &mut [f32],
        dparams: &mut [f32],
        _scratch: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        saved: &[f32],
        params: &[f32],
        d: Dims,
    ) -> Result<()> {
        let lens = self.check(d)?;
        self.block
            .backward(dinp, dparams, dout, inp, saved, params, &lens)
            .map_err(moe_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AdamWState, Gpt, GptConfig};
    use weft_kernels::AdamW;
    use weft_moe::{BiasBalancer, Gate, Router};

    #[test]
    fn a_moe_gpt_trains_and_logs_load_per_layer() {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            vocab_size: 32,
            block_size: 8,
            tied_embeddings: true,
            layer_norm_epsilon: 1e-5,
        };
        let moe = MoeConfig {
            router: Router::top_k(4, 2)
                .with_gate(Gate::Sigmoid)
                .with_normalize(true),
            shared_expert: true,
            ..MoeConfig::new(16, 4, 2)
        };
        let (ffn, stats) = MoeFfn::new(moe).unwrap();
        let mut model = Gpt::with_ffn(cfg, Box::new(ffn)).unwrap();
        model.init_gpt2(1);
        let bias_name = "transformer.h.0.mlp.router.selection_bias";
        assert_eq!(model.param(bias_name).unwrap().len(), 4);
        let mut acts = model.activations(2, 8).unwrap();
        let tokens: Vec<u32> = (0..16).map(|i| (i * 5 % 32) as u32).collect();
        let targets: Vec<u32> = (0..16).map(|i| ((i * 5 + 1) % 32) as u32).collect();
        let mut opt = AdamWState::new(&model);
        let mut losses = Vec::new();
        for _ in 0..8 {
            losses.push(
                model
                    .forward(&mut acts, &tokens, Some(&targets))
                    .unwrap()
                    .unwrap(),
            );
            model.zero_grad();
            model.backward(&mut acts).unwrap();
            model
                .adamw_step(
                    &mut opt,
                    &AdamW {
                        lr: 1e-2,
                        ..AdamW::default()
                    },
                )
                .unwrap();
            let log = stats.take();
            assert_eq!(log.len(), 2);
            for f in &log {
                assert_eq!(f.stats.tokens_per_expert.iter().sum::<u64>(), 32);
            }
        }
        assert!(losses[7] < losses[0], "{losses:?}");
        // AdamW leaves the selection bias alone (its gradient is 0) ...
        assert!(model.param(bias_name).unwrap().iter().all(|&b| b == 0.0));
        // ... and the balancer moves it.
        let mut b = model.param(bias_name).unwrap().to_vec();
        BiasBalancer::new(1e-3)
            .update(&mut b, &[10, 2, 10, 10])
            .unwrap();
        assert_eq!(b[1], 1e-3);
    }
}
