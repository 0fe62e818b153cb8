//! The mixture-of-experts feed-forward block ([`weft_moe::MoeBlock`]) as
//! a [`FeedForward`].
//!
//! Its tensors live under `transformer.h.{l}.mlp.` (`router.weight`,
//! `router.selection_bias`, `experts.c_fc.weight (E,C,H)`, ...). The
//! selection bias is never decayed and its gradient is always 0, so AdamW
//! leaves it alone; the trainer sets it with
//! [`weft_moe::BiasBalancer::update`] after each step from the load that
//! [`MoeStats::take`] returns. Each forward appends its layer index
//! ([`Dims::layer`]) and its [`weft_moe::MoeForward`] (load statistics and
//! the auxiliary loss value) to the shared log behind [`MoeStats`]; a
//! pipeline stage's log holds its own layers only, in the order its
//! schedule ran them.
//!
//! The experts run grouped over the whole batch, so the block is not
//! batch-invariant whatever [`Dims::mode`] says.
//!
//! # Expert parallelism
//! [`MoeFfn::with_expert_parallel`] builds the block with its experts
//! sharded over an `ep` communicator ([`weft_moe::ExpertParallel`]): rank
//! `r` of the group holds experts `r·E/ep .. (r+1)·E/ep`, so its
//! `mlp.experts.*` tensors have `E/ep` rows in their first dimension; the
//! router, the selection bias and the shared expert are replicated. Each
//! forward and backward is collective over the group (tokens travel to
//! their expert's rank and back with `all_to_all_v`), so every rank of the
//! group must run the same number of forwards and backwards, in the same
//! order, with the same `B·T`-independent call pattern (their batches may
//! differ in content). Activations are a fixed number of floats per token
//! ([`saved_len`](FeedForward::saved_len)): the
//! backward recomputes the experts' hidden activations (one more dispatch
//! and expert forward). Results equal those of the unsharded block run on
//! each rank's tokens (test `model/tests/moe_ep.rs`).
//!
//! The expert tensors carry the placement `Shard(0)` on the `ep` axis
//! (every other tensor is replicated there), and everything a training
//! loop does with them follows from it — in `weft-parallel`, once for every
//! layout ([`crate::ParallelGpt`] runs it):
//! 1. **Initialisation and checkpoints**: `weft_parallel::extract` takes a
//!    rank's experts out of the whole model (the same on every rank), and
//!    `weft_parallel::gather_whole` assembles the whole model from the
//!    ranks' parts.
//! 2. **Gradients**: replicated tensors hold `∂L_r/∂θ` of this rank's
//!    tokens and are averaged over the data-parallel group; expert tensors
//!    already hold the sum over their expert group's tokens, and are summed
//!    over the ranks holding the same experts (`GradReducer`, by
//!    `reduce_group`) before the division by the global micro-batch count.
//! 3. **Gradient norm**: expert shards are distinct and their squares are
//!    summed over the expert group; replicated tensors count once
//!    (`GradNorm`).
//! 4. **Load statistics and the selection bias**: [`MoeStats`] holds this
//!    rank's tokens only; sum each layer's [`weft_moe::LoadStats`] over the
//!    data-parallel group before writing `expert_load.jsonl` and before
//!    [`weft_moe::BiasBalancer::update`], so every rank applies the same
//!    bias update.
//! 5. **Evaluation** forwards are collective too: run them on every rank
//!    of the group.

use std::sync::{Arc, Mutex};

use weft_moe::weft_collectives::Communicator;
use weft_moe::{ExpertParallel, MoeBlock, MoeConfig, MoeForward};

use crate::error::{Error, Result};
use weft_parallel::{DimSet, Placement, Placements};

use crate::ffn::{Dims, FeedForward, ParamShape, wide_input};
use weft_kernels::LinearInput;

/// A mixture-of-experts block implementing [`FeedForward`], its first
/// layers optionally dense ([`with_first_dense`](Self::with_first_dense)).
#[derive(Debug)]
pub struct MoeFfn {
    engine: Engine,
    log: Arc<Mutex<Vec<(usize, MoeForward)>>>,
    /// Layers `0..first_dense` run `dense` instead of the experts.
    first_dense: usize,
    dense: Option<Arc<dyn FeedForward>>,
}

/// The unsharded block, or this rank's shard with its expert group.
enum Engine {
    Local(MoeBlock),
    Sharded {
        ep: ExpertParallel,
        comm: Arc<dyn Communicator>,
    },
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Engine::Local(b) => f.debug_tuple("Local").field(b).finish(),
            Engine::Sharded { ep, comm } => f
                .debug_struct("Sharded")
                .field("ep", ep)
                .field("rank", &comm.rank())
                .field("size", &comm.size())
                .finish(),
        }
    }
}

/// The trainer's handle on the statistics every [`MoeFfn`] forward logs.
#[derive(Clone, Debug)]
pub struct MoeStats(Arc<Mutex<Vec<(usize, MoeForward)>>>);

impl MoeStats {
    /// Takes the logged forwards as `(layer, forward)` pairs, oldest first
    /// (one per MoE layer per forward pass).
    pub fn take(&self) -> Vec<(usize, MoeForward)> {
        std::mem::take(
            &mut *self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// The step's expert load of every one of `layers` layers (`experts`
    /// per layer) over the whole global batch: the forwards logged since
    /// the last take merged per layer (a layer runs once per micro-batch;
    /// a pipeline stage logs its own layers only), then summed over the
    /// mesh's data-parallel group and its pipeline group (a layer this
    /// rank does not hold counts as zero here). Tensor-parallel ranks of a
    /// layer route the same tokens, so they are not summed. Collective
    /// over those groups: every rank gets every layer's load, as one rank
    /// of the whole batch would.
    ///
    /// # Errors
    /// [`Error::Config`] for a layer the model does not have; a collective
    /// error.
    pub fn step_loads(
        &self,
        mesh: &weft_parallel::ParallelMesh,
        layers: usize,
        experts: usize,
    ) -> Result<Vec<weft_moe::LoadStats>> {
        use weft_collectives::{CommunicatorExt, ReduceOp};
        let mut per_layer: Vec<Option<weft_moe::LoadStats>> = vec![None; layers];
        for (l, f) in self.take() {
            match per_layer.get_mut(l) {
                Some(Some(s)) => s.merge(&f.stats),
                Some(slot @ None) => *slot = Some(f.stats),
                None => {
                    return Err(Error::Config {
                        field: "n_layer",
                        reason: format!(
                            "mixture-of-experts statistics logged for layer {l} of a {layers}-layer model"
                        ),
                    });
                }
            }
        }
        let mut per_layer: Vec<weft_moe::LoadStats> = per_layer
            .into_iter()
            .map(|s| {
                s.unwrap_or_else(|| weft_moe::LoadStats {
                    tokens_per_expert: vec![0; experts],
                    dropped: 0,
                    tokens: 0,
                    entropy_sum: 0.0,
                })
            })
            .collect();
        let mut flat = Vec::new();
        for s in &per_layer {
            flat.extend(s.tokens_per_expert.iter().map(|&x| x as f64));
            flat.extend([s.dropped as f64, s.tokens as f64, s.entropy_sum]);
        }
        // Counts are small integers, exact in f64 in any order; the
        // context-parallel ranks routed other tokens of the same sequences
        for group in [mesh.group(DimSet::DP.with(DimSet::CP)), mesh.pp()] {
            if group.size() > 1 {
                group.all_reduce(&mut flat, ReduceOp::Sum)?;
            }
        }
        let mut it = flat.into_iter();
        for s in &mut per_layer {
            for x in &mut s.tokens_per_expert {
                *x = it.next().unwrap_or(0.0) as u64;
            }
            s.dropped = it.next().unwrap_or(0.0) as u64;
            s.tokens = it.next().unwrap_or(0.0) as u64;
            s.entropy_sum = it.next().unwrap_or(0.0);
        }
        Ok(per_layer)
    }
}

pub(crate) fn moe_err(e: weft_moe::Error) -> Error {
    match e {
        weft_moe::Error::Kernel(k) => Error::Kernel(k),
        other => Error::Config {
            field: "model.moe",
            reason: other.to_string(),
        },
    }
}

impl MoeFfn {
    /// Whether every token's routing and loss are its own: dropless
    /// token-choice top-k without the auxiliary loss (the selection bias
    /// balances). Only such a block runs under context parallelism, whose
    /// ranks each hold part of every sequence.
    pub fn per_token(&self) -> bool {
        let cfg = self.config();
        cfg.aux.is_none() && cfg.router.kind == weft_moe::RouterKind::Dropless
    }

    /// A block with configuration `cfg` (its `channels` must equal the
    /// model's `n_embd`) and the handle on its statistics.
    ///
    /// # Errors
    /// [`Error::Config`] if the MoE configuration is invalid.
    pub fn new(cfg: MoeConfig) -> Result<(Self, MoeStats)> {
        let block = MoeBlock::new(cfg).map_err(moe_err)?;
        Ok(Self::with_engine(Engine::Local(block)))
    }

    /// This rank's shard of a block whose experts are sharded over the
    /// expert group `comm` (its size is `ep`, its rank this rank's place in
    /// the group); see the module docs for what the training loop does
    /// around it.
    ///
    /// # Errors
    /// [`Error::Config`] if the MoE configuration is invalid or the group's
    /// size does not divide the number of experts.
    pub fn with_expert_parallel(
        cfg: MoeConfig,
        comm: Arc<dyn Communicator>,
    ) -> Result<(Self, MoeStats)> {
        let ep = ExpertParallel::new(cfg, comm.size(), comm.rank()).map_err(moe_err)?;
        Ok(Self::with_engine(Engine::Sharded { ep, comm }))
    }

    fn with_engine(engine: Engine) -> (Self, MoeStats) {
        let log = Arc::new(Mutex::new(Vec::new()));
        (
            MoeFfn {
                engine,
                log: Arc::clone(&log),
                first_dense: 0,
                dense: None,
            },
            MoeStats(log),
        )
    }

    /// This block with its first `layers` layers dense: they run `dense`
    /// (the model's dense feed-forward block, [`SwiGlu`](crate::SwiGlu)
    /// of width `ffn_hidden` or [`Mlp`](crate::Mlp)) under its own
    /// tensor names (`mlp.gate_up.weight`, ...) and placements, and log
    /// no expert load; the later layers are the mixture of experts
    /// (DeepSeek-V3's `first_k_dense_replace`, Qwen3-MoE's
    /// `mlp_only_layers = [0, .., k-1]`). 0 (the default) makes every
    /// layer a mixture of experts.
    #[must_use]
    pub fn with_first_dense(self, layers: usize, dense: Arc<dyn FeedForward>) -> Self {
        MoeFfn {
            first_dense: layers,
            dense: (layers > 0).then_some(dense),
            ..self
        }
    }

    /// Layers at the start of the model that are dense (see
    /// [`with_first_dense`](Self::with_first_dense)).
    pub fn first_dense(&self) -> usize {
        self.first_dense
    }

    /// The dense block of the first layers, if any.
    pub fn dense(&self) -> Option<&Arc<dyn FeedForward>> {
        self.dense.as_ref()
    }

    /// The dense block if layer `layer` is one of the dense first ones.
    fn dense_at(&self, layer: usize) -> Option<&dyn FeedForward> {
        self.dense.as_deref().filter(|_| layer < self.first_dense)
    }

    /// The MoE configuration.
    pub fn config(&self) -> &MoeConfig {
        match &self.engine {
            Engine::Local(b) => b.config(),
            Engine::Sharded { ep, .. } => ep.config(),
        }
    }

    /// Size of the expert group (1 without expert parallelism).
    pub fn ep_size(&self) -> usize {
        match &self.engine {
            Engine::Local(_) => 1,
            Engine::Sharded { comm, .. } => comm.size(),
        }
    }

    /// This rank's place in the expert group (0 without expert
    /// parallelism).
    pub fn ep_rank(&self) -> usize {
        match &self.engine {
            Engine::Local(_) => 0,
            Engine::Sharded { comm, .. } => comm.rank(),
        }
    }

    /// Experts whose parameters this rank holds (`E / ep`).
    pub fn local_experts(&self) -> usize {
        self.config().router.experts / self.ep_size()
    }

    /// Whether the model tensor `name` is an expert tensor, sharded under
    /// expert parallelism (`transformer.h.{l}.mlp.experts.*`) rather than
    /// replicated (see the module docs for how their gradients are
    /// reduced).
    pub fn is_expert_param(name: &str) -> bool {
        name.contains(".mlp.experts.")
    }

    /// What an expert layer saves (a dense layer may save more).
    fn moe_saved_len(&self, d: &Dims<'_>) -> usize {
        d.n()
            * match &self.engine {
                Engine::Local(b) => b.config().saved_per_token(),
                Engine::Sharded { ep, .. } => ep.saved_per_token(),
            }
    }

    fn check(&self, d: Dims<'_>) -> Result<Vec<usize>> {
        let c = self.config().channels;
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
    /// The router, selection bias and shared expert replicated; the
    /// experts' tensors sharded over the expert group by their first
    /// dimension (a rank holds `E/ep` experts). Replicated over `tp`: the
    /// block runs whole on every tensor-parallel rank.
    fn params(&self, _c: usize) -> Vec<ParamShape> {
        let experts = self.config().router.experts;
        self.config()
            .tensors(experts)
            .into_iter()
            .map(|t| {
                let mut placements = Placements::REPLICATED;
                if Self::is_expert_param(&format!(".mlp.{}", t.name)) {
                    placements.ep = Placement::shard(0);
                }
                ParamShape {
                    suffix: format!("mlp.{}", t.name),
                    shape: t.shape,
                    decay: t.decay,
                    placements,
                }
            })
            .collect()
    }

    /// The dense block's tensors in the first dense layers, the mixture
    /// of experts' in the others.
    fn layer_params(&self, c: usize, layer: usize) -> Vec<ParamShape> {
        match self.dense_at(layer) {
            Some(dense) => dense.layer_params(c, layer),
            None => self.params(c),
        }
    }

    fn moe(&self) -> Option<&MoeFfn> {
        Some(self)
    }

    fn expert_parallel(&self) -> (usize, usize) {
        (self.ep_rank(), self.ep_size())
    }

    /// The larger of the experts' and the dense block's (every layer's
    /// activations are planned alike).
    fn saved_len(&self, d: &Dims<'_>) -> usize {
        let moe = self.moe_saved_len(d);
        self.dense
            .as_ref()
            .map_or(moe, |dense| moe.max(dense.saved_len(d)))
    }

    /// The dense block's, if any: the experts allocate their own grouped
    /// buffers.
    fn scratch_len(&self, d: &Dims<'_>) -> usize {
        self.dense.as_ref().map_or(0, |dense| dense.scratch_len(d))
    }

    /// The dense block's in the dense layers (and when planning, layer
    /// 0's); 0 in the others, whose halves each run the whole backward.
    fn split_saved_len(&self, d: &Dims<'_>) -> usize {
        self.dense_at(d.layer)
            .map_or(0, |dense| dense.split_saved_len(d))
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_input(
        &self,
        dinp: &mut [f32],
        wsaved: &mut [f32],
        sink: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        inp: LinearInput<'_, f32>,
        saved: &[f32],
        params: &[f32],
        d: Dims<'_>,
    ) -> Result<()> {
        if let Some(dense) = self.dense_at(d.layer) {
            let wsaved = &mut wsaved[..dense.split_saved_len(&d)];
            let saved = &saved[..dense.saved_len(&d)];
            return dense.backward_input(dinp, wsaved, sink, scratch, dout, inp, saved, params, d);
        }
        weft_kernels::zero(sink);
        self.backward(dinp, sink, scratch, dout, inp, saved, params, d)
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_weight(
        &self,
        dparams: &mut [f32],
        wsaved: &[f32],
        sink: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        inp: LinearInput<'_, f32>,
        saved: &[f32],
        params: &[f32],
        d: Dims<'_>,
    ) -> Result<()> {
        if let Some(dense) = self.dense_at(d.layer) {
            let wsaved = &wsaved[..dense.split_saved_len(&d)];
            let saved = &saved[..dense.saved_len(&d)];
            return dense
                .backward_weight(dparams, wsaved, sink, scratch, dout, inp, saved, params, d);
        }
        weft_kernels::zero(sink);
        self.backward(sink, dparams, scratch, dout, inp, saved, params, d)
    }

    /// Under sequence parallelism the block runs on every token (it is
    /// replicated over `tp`) into a buffer of its own, and keeps this
    /// rank's rows.
    fn forward(
        &self,
        out: &mut [f32],
        saved: &mut [f32],
        scratch: &mut [f32],
        inp: LinearInput<'_, f32>,
        params: &[f32],
        d: Dims<'_>,
    ) -> Result<()> {
        if let Some(dense) = self.dense_at(d.layer) {
            let saved = &mut saved[..dense.saved_len(&d)];
            return dense.forward(out, saved, scratch, inp, params, d);
        }
        let lens = self.check(d)?;
        let saved = &mut saved[..self.moe_saved_len(&d)];
        let inp = wide_input(inp, "the mixture of experts")?;
        let sp = d.sequence_parallel();
        let mut whole = if sp {
            vec![0.0f32; d.n() * d.c]
        } else {
            Vec::new()
        };
        let y: &mut [f32] = if sp { &mut whole } else { out };
        let f = match &self.engine {
            Engine::Local(b) => b
                .with_precision(d.precision)
                .forward(y, saved, inp, params, &lens),
            Engine::Sharded { ep, comm } => ep.with_precision(d.precision).forward_flat(
                comm.as_ref(),
                y,
                saved,
                inp,
                params,
                &lens,
            ),
        }
        .map_err(moe_err)?;
        if let (true, Some(tp)) = (sp, d.tp) {
            let first = tp.first_row(d.n()) * d.c;
            out.copy_from_slice(&whole[first..first + out.len()]);
        }
        if !d.replay {
            self.log
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push((d.layer, f));
        }
        Ok(())
    }

    fn backward(
        &self,
        dinp: &mut [f32],
        dparams: &mut [f32],
        scratch: &mut [f32],
        dout: &[f32],
        inp: LinearInput<'_, f32>,
        saved: &[f32],
        params: &[f32],
        d: Dims<'_>,
    ) -> Result<()> {
        if let Some(dense) = self.dense_at(d.layer) {
            let saved = &saved[..dense.saved_len(&d)];
            return dense.backward(dinp, dparams, scratch, dout, inp, saved, params, d);
        }
        let lens = self.check(d)?;
        let saved = &saved[..self.moe_saved_len(&d)];
        let inp = wide_input(inp, "the mixture of experts")?;
        // Under sequence parallelism: the whole output gradient, gathered,
        // and the whole input gradient, of which this rank keeps its rows.
        let sp = d.sequence_parallel();
        let mut dy_all = vec![0.0f32; if sp { d.n() * d.c } else { 0 }];
        let mut dx_all = vec![0.0f32; dy_all.len()];
        if let Some(tp) = d.tp.filter(|_| sp) {
            tp.all_gather(dout, &mut dy_all)?;
        }
        let (dy, dx): (&[f32], &mut [f32]) = if sp {
            (&dy_all, &mut dx_all)
        } else {
            (dout, dinp)
        };
        match &self.engine {
            Engine::Local(b) => b
                .with_precision(d.precision)
                .with_loss_scale(f64::from(d.loss_scale))
                .backward(dx, dparams, dy, inp, saved, params, &lens),
            Engine::Sharded { ep, comm } => ep
                .with_precision(d.precision)
                .with_loss_scale(f64::from(d.loss_scale))
                .backward_flat(comm.as_ref(), dx, dparams, dy, inp, saved, params, &lens),
        }
        .map_err(moe_err)?;
        if let Some(tp) = d.tp.filter(|_| sp) {
            let first = tp.first_row(d.n()) * d.c;
            let n = dinp.len();
            weft_kernels::accumulate(dinp, &dx_all[first..first + n])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Gpt, GptConfig};
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
            arch: crate::BlockArch::GPT2,
        };
        let moe = MoeConfig {
            router: Router::top_k(4, 2)
                .with_gate(Gate::Sigmoid)
                .with_normalize(true),
            shared_experts: 1,
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
        let mut opt = model.adamw_state();
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
            assert_eq!(log.iter().map(|(l, _)| *l).collect::<Vec<_>>(), [0, 1]);
            for (_, f) in &log {
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
