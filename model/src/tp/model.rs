//! The whole tensor-parallel GPT-2 on one rank.

use std::ops::Range;

use weft_collectives::{Communicator, CommunicatorExt};
use weft_kernels::{
    AdamW, Mode, fused_classifier, layernorm_backward, matmul_backward_wt, matmul_forward_wt,
};

use super::block::{Link, Shape, TpBlock, TpBlockActs, TpScratch};
use super::shard::check_config;
use super::{CommClock, Result, TpLayout, TpOptions, VocabShard, check_len, shape_err};
use crate::config::GptConfig;
use crate::gpt::Gpt;
use weft_parallel::ParamLayout;

/// Activation buffers of one rank for one micro-batch shape (plan with
/// [`TpGpt::activations`]).
#[derive(Debug)]
pub struct TpActivations {
    s: Shape,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    has_targets: bool,
    encoded: Vec<f32>, // (ns, C)
    layers: Vec<TpBlockActs>,
    lnf: Vec<f32>,      // (N, C), gathered in SP
    lnf_mean: Vec<f32>, // (ns)
    lnf_rstd: Vec<f32>, // (ns)
    logits: Vec<f32>,   // (N, V_l); the gradient after backward
    losses: Vec<f32>,   // (N)
    stats: Vec<f32>,    // (2N)
    scratch: TpScratch,
    dres: Vec<f32>, // (ns, C)
}

impl TpActivations {
    /// Bytes held by this rank.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(TpBlockActs::bytes).sum::<usize>()
            + self.scratch.bytes()
            + 4 * (self.tokens.len()
                + self.targets.len()
                + self.encoded.len()
                + self.lnf.len()
                + self.lnf_mean.len()
                + self.lnf_rstd.len()
                + self.logits.len()
                + self.losses.len()
                + self.stats.len()
                + self.dres.len())
    }

    /// This rank's logits `(B·T, V_l)` (columns [`VocabShard::range`]) of
    /// the last forward; after a backward, their gradient.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Per-token losses `(B·T)` of the last forward with targets (the same
    /// on every rank).
    pub fn losses(&self) -> &[f32] {
        &self.losses
    }
}

/// Per-rank memory of a [`TpGpt`], in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpMemory {
    /// Parameters on this rank.
    pub params: usize,
    /// Gradients (same as `params`).
    pub grads: usize,
    /// AdamW moments (twice `params`).
    pub adam: usize,
    /// Parameter bytes of split tensors (falls as `1/tp`).
    pub split_params: usize,
    /// Parameter bytes of replicated tensors (layernorms, `wpe`,
    /// row-parallel biases; the same at every tp).
    pub replicated_params: usize,
}

/// Bytes *sent*, summed over all ranks of the group, by the tp collectives
/// of one forward + backward of a `B×T` micro-batch, per collective — the
/// formula behind [`TpGpt::traffic_per_step`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TpTraffic {
    /// All-reduce bytes.
    pub all_reduce: u64,
    /// Reduce-scatter bytes.
    pub reduce_scatter: u64,
    /// All-gather bytes.
    pub all_gather: u64,
}

impl TpTraffic {
    /// All bytes.
    pub fn total(&self) -> u64 {
        self.all_reduce + self.reduce_scatter + self.all_gather
    }
}

/// A GPT-2 split over a tp group: this rank's shard of every parameter
/// ([`TpLayout`]), its gradients, and the forward/backward that take the
/// group's [`Communicator`].
///
/// Every rank of the group calls [`forward`](Self::forward) and
/// [`backward`](Self::backward) with the same tokens and targets; each gets
/// the loss of the whole model and the gradient of its own shard.
#[derive(Debug)]
pub struct TpGpt {
    config: GptConfig,
    opts: TpOptions,
    layout: TpLayout,
    full_layout: ParamLayout,
    block: TpBlock,
    vocab: VocabShard,
    clock: CommClock,
    /// This rank's parameters, in [`TpLayout`] order.
    pub params: Vec<f32>,
    /// This rank's gradients, same layout; [`backward`](Self::backward)
    /// accumulates into them.
    pub grads: Vec<f32>,
}

impl TpGpt {
    /// Rank `rank` of a `tp`-way split of a dense GPT-2, parameters zero.
    ///
    /// # Errors
    /// [`Error::Shape`](super::Error::Shape) if `tp` does not divide
    /// `n_head` or exceeds `vocab_size`, or `rank >= tp`;
    /// [`Error::Model`](super::Error::Model) for an invalid configuration.
    pub fn new(config: GptConfig, tp: usize, rank: usize, opts: TpOptions) -> Result<Self> {
        check_config(&config, tp, rank)?;
        let layout = TpLayout::new(&config, tp, rank)?;
        let full_layout = crate::params::dense_layout(&config)?;
        let block = TpBlock::new(&config, tp);
        let vocab = VocabShard::new(config.vocab_size, tp, rank)?;
        let n = layout.len();
        Ok(TpGpt {
            config,
            opts,
            layout,
            full_layout,
            block,
            vocab,
            clock: CommClock::default(),
            params: vec![0.0; n],
            grads: vec![0.0; n],
        })
    }

    /// This rank's shard of a whole model (loaded from a Hugging Face
    /// folder with [`crate::hf::load`], or initialised): every rank of the
    /// group calls this with the same model.
    ///
    /// # Errors
    /// As [`new`](Self::new); [`Error::Shape`](super::Error::Shape) if the
    /// model's feed-forward block is not GPT-2's MLP.
    pub fn from_full(full: &Gpt, tp: usize, rank: usize, opts: TpOptions) -> Result<Self> {
        let mut m = Self::new(full.config().clone(), tp, rank, opts)?;
        m.load_full(&full.params)?;
        Ok(m)
    }

    /// Replaces this rank's parameters by its shard of `full` (a whole
    /// model's parameters in [`ParamLayout`] order).
    ///
    /// # Errors
    /// [`Error::Shape`](super::Error::Shape) on a wrong length.
    pub fn load_full(&mut self, full: &[f32]) -> Result<()> {
        self.params = self.layout.shard(&self.full_layout, full)?;
        Ok(())
    }

    /// The configuration of the whole model.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// The communication options.
    pub fn options(&self) -> &TpOptions {
        &self.opts
    }

    /// This rank's layout (names, splits, offsets, checkpoint regions).
    pub fn layout(&self) -> &TpLayout {
        &self.layout
    }

    /// The whole model's layout.
    pub fn full_layout(&self) -> &ParamLayout {
        &self.full_layout
    }

    /// This rank's vocabulary range.
    pub fn vocab(&self) -> &VocabShard {
        &self.vocab
    }

    /// The tp degree.
    pub fn tp(&self) -> usize {
        self.layout.tp()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.layout.rank()
    }

    /// A named parameter tensor of this rank.
    pub fn param(&self, name: &str) -> Option<&[f32]> {
        self.layout.get(name).map(|t| &self.params[t.range()])
    }

    /// A named gradient tensor of this rank.
    pub fn grad(&self, name: &str) -> Option<&[f32]> {
        self.layout.get(name).map(|t| &self.grads[t.range()])
    }

    /// Nanoseconds this rank has spent in tp collectives since creation or
    /// the last [`reset_comm_nanos`](Self::reset_comm_nanos) (on the thread
    /// backend this includes waiting for the slowest peer).
    pub fn comm_nanos(&self) -> u64 {
        self.clock.nanos()
    }

    /// Resets [`comm_nanos`](Self::comm_nanos).
    pub fn reset_comm_nanos(&self) {
        self.clock.reset();
    }

    /// Per-rank memory of parameters, gradients and AdamW moments.
    pub fn memory(&self) -> TpMemory {
        let p = 4 * self.layout.len();
        TpMemory {
            params: p,
            grads: p,
            adam: 2 * p,
            split_params: 4 * self.layout.split_len(),
            replicated_params: 4 * self.layout.replicated_len(),
        }
    }

    // Buffer ranges of this rank's shard, in TpLayout order.
    fn wte_len(&self) -> usize {
        self.vocab.len() * self.config.n_embd
    }
    fn wpe_range(&self) -> Range<usize> {
        let s = self.wte_len();
        s..s + self.config.block_size * self.config.n_embd
    }
    fn block_range(&self, l: usize) -> Range<usize> {
        let s = self.wpe_range().end + l * self.block.len();
        s..s + self.block.len()
    }
    fn lnf_range(&self) -> Range<usize> {
        let s = self.block_range(self.config.n_layer).start;
        s..s + 2 * self.config.n_embd
    }
    fn head_range(&self) -> Range<usize> {
        if self.config.tied_embeddings {
            0..self.wte_len()
        } else {
            let s = self.lnf_range().end;
            s..s + self.wte_len()
        }
    }

    fn shape(&self, b: usize, t: usize) -> Result<Shape> {
        let tp = self.tp();
        if b == 0 || t == 0 || t > self.config.block_size {
            return Err(crate::Error::Batch {
                reason: format!(
                    "B={b}, T={t}: need B >= 1 and 1 <= T <= block_size = {}",
                    self.config.block_size
                ),
            }
            .into());
        }
        let sp = self.opts.sequence_parallel;
        if sp && !(b * t).is_multiple_of(tp) {
            return Err(shape_err(
                "sequence parallelism",
                format!("B·T = {b}·{t} tokens do not split evenly over tp = {tp}"),
            ));
        }
        Ok(Shape { b, t, sp, tp })
    }

    /// Plans this rank's activations for micro-batches of `b` sequences of
    /// `t` tokens.
    ///
    /// # Errors
    /// [`Error::Model`](super::Error::Model) ([`crate::Error::Batch`]) if
    /// `t` exceeds `block_size` or `b·t` is 0; [`Error::Shape`](super::Error::Shape)
    /// if sequence parallelism is on and `tp` does not divide `b·t`.
    pub fn activations(&self, b: usize, t: usize) -> Result<TpActivations> {
        let s = self.shape(b, t)?;
        let (n, ns, c) = (s.n(), s.ns(), self.config.n_embd);
        Ok(TpActivations {
            s,
            tokens: vec![0; n],
            targets: vec![0; n],
            has_targets: false,
            encoded: vec![0.0; ns * c],
            layers: (0..self.config.n_layer)
                .map(|_| self.block.acts(s))
                .collect(),
            lnf: vec![0.0; n * c],
            lnf_mean: vec![0.0; ns],
            lnf_rstd: vec![0.0; ns],
            logits: vec![0.0; n * self.vocab.len()],
            losses: vec![0.0; n],
            stats: vec![0.0; 2 * n],
            scratch: self.block.scratch(s),
            dres: vec![0.0; ns * c],
        })
    }

    fn link<'a>(&'a self, comm: &'a dyn Communicator) -> Result<Link<'a>> {
        if comm.size() != self.tp() || comm.rank() != self.rank() {
            return Err(shape_err(
                "communicator",
                format!(
                    "model is rank {} of tp = {}, communicator is rank {} of {}",
                    self.rank(),
                    self.tp(),
                    comm.rank(),
                    comm.size()
                ),
            ));
        }
        Ok(Link {
            comm,
            opts: self.opts,
            clock: &self.clock,
        })
    }

    /// Forward over `tokens (B,T)` (the same on every rank of the group).
    /// With `targets` it returns the mean cross-entropy of the whole model
    /// (the same value on every rank); without, `None` and only the logits
    /// ([`TpActivations::logits`], this rank's vocabulary columns) are
    /// meaningful.
    ///
    /// # Errors
    /// [`Error::Model`](super::Error::Model) if `tokens`/`targets` do not
    /// hold `B·T` ids; a kernel error for an id outside the vocabulary;
    /// [`Error::Shape`](super::Error::Shape) if `comm` is not this model's
    /// group; [`Error::Comm`](super::Error::Comm).
    pub fn forward(
        &self,
        comm: &dyn Communicator,
        acts: &mut TpActivations,
        tokens: &[u32],
        targets: Option<&[u32]>,
    ) -> Result<Option<f64>> {
        let link = self.link(comm)?;
        let s = acts.s;
        let (n, ns, c) = (s.n(), s.ns(), self.config.n_embd);
        if tokens.len() != n || targets.is_some_and(|x| x.len() != n) {
            return Err(crate::Error::Batch {
                reason: format!(
                    "activations planned for B*T = {}*{} = {n} tokens, got {} inputs and {} targets",
                    s.b,
                    s.t,
                    tokens.len(),
                    targets.map_or(0, <[u32]>::len)
                ),
            }
            .into());
        }
        if let Some(tg) = targets {
            weft_kernels::check_tokens("tp forward targets", tg, self.config.vocab_size)?;
        }
        acts.tokens.copy_from_slice(tokens);
        acts.has_targets = false;
        let p = &self.params;
        // Vocabulary-parallel embedding: local rows, summed over the group.
        let sc = &mut acts.scratch;
        self.vocab
            .embed(&mut sc.tmp, tokens, &p[..self.wte_len()], c)?;
        let first = if s.sp {
            link.reduce_scatter(&sc.tmp, &mut acts.encoded)?;
            self.rank() * ns
        } else {
            link.all_reduce(&mut sc.tmp)?;
            acts.encoded.copy_from_slice(&sc.tmp);
            0
        };
        let wpe = &p[self.wpe_range()];
        for (i, row) in acts.encoded.chunks_exact_mut(c).enumerate() {
            let pos = (first + i) % s.t;
            for (o, &x) in row.iter_mut().zip(&wpe[pos * c..(pos + 1) * c]) {
                *o += x;
            }
        }
        for l in 0..acts.layers.len() {
            let (prev, cur) = acts.layers.split_at_mut(l);
            let inp: &[f32] = if l == 0 {
                &acts.encoded
            } else {
                &prev[l - 1].out
            };
            self.block.forward(
                &link,
                s,
                &mut cur[0],
                inp,
                &p[self.block_range(l)],
                &mut acts.scratch,
            )?;
        }
        // Head: ln_f (gathered under SP), vocabulary-parallel logits.
        let last = &acts.layers[acts.layers.len() - 1].out;
        let lnf = &p[self.lnf_range()];
        self.block.layernorm_gather(
            &link,
            s,
            &mut acts.lnf,
            &mut acts.lnf_mean,
            &mut acts.lnf_rstd,
            last,
            &lnf[..c],
            &lnf[c..],
            &mut acts.scratch.tmp_s,
        )?;
        let vl = self.vocab.len();
        matmul_forward_wt(
            &mut acts.logits,
            &acts.lnf,
            &p[self.head_range()],
            None,
            s.b,
            s.t,
            c,
            vl,
            Mode::BatchInvariant,
        )?;
        let Some(tg) = targets else {
            return Ok(None);
        };
        acts.targets.copy_from_slice(tg);
        acts.has_targets = true;
        if self.tp() == 1 {
            fused_classifier(&mut acts.logits, &mut acts.losses, tg, None, n, vl, vl)?;
        } else {
            self.vocab.cross_entropy_with(
                &mut |buf: &mut [f32], max: bool| {
                    if max {
                        link.all_reduce_max(buf)
                    } else {
                        link.all_reduce(buf)
                    }
                },
                &acts.logits,
                tg,
                &mut acts.losses,
                &mut acts.stats,
            )?;
        }
        let sum: f64 = acts.losses.iter().map(|&x| f64::from(x)).sum();
        #[allow(clippy::cast_precision_loss)]
        Ok(Some(sum / n as f64))
    }

    /// Sets every gradient to zero.
    pub fn zero_grad(&mut self) {
        weft_kernels::zero(&mut self.grads);
    }

    /// Backward of the mean loss of the last [`forward`](Self::forward)
    /// (which must have had targets), accumulating this rank's shard of
    /// the gradient into [`grads`](Self::grads). Under sequence parallelism
    /// it ends with one all-reduce of the layernorms' gradients (partial per
    /// rank; see the [module docs](super)).
    ///
    /// # Errors
    /// [`Error::Model`](super::Error::Model) if the last forward had no
    /// targets; [`Error::Shape`](super::Error::Shape) if `comm` is not this
    /// model's group; [`Error::Comm`](super::Error::Comm).
    pub fn backward(&mut self, comm: &dyn Communicator, acts: &mut TpActivations) -> Result<()> {
        if !acts.has_targets {
            return Err(crate::Error::Batch {
                reason: "backward needs a forward with targets first".into(),
            }
            .into());
        }
        acts.has_targets = false;
        self.link(comm)?;
        let s = acts.s;
        let (n, ns, c) = (s.n(), s.ns(), self.config.n_embd);
        let vl = self.vocab.len();
        let tp = self.tp();
        let head = self.head_range();
        let lnf_r = self.lnf_range();
        let wpe = self.wpe_range();
        let blocks: Vec<Range<usize>> = (0..self.config.n_layer)
            .map(|l| self.block_range(l))
            .collect();
        let ln_ranges = self.layernorm_ranges();
        let TpGpt {
            params: p,
            grads: g,
            block,
            vocab,
            clock,
            opts,
            ..
        } = self;
        let link = Link {
            comm,
            opts: *opts,
            clock: &*clock,
        };
        #[allow(clippy::cast_precision_loss)]
        let dloss = 1.0 / n as f32;
        if tp == 1 {
            fused_classifier(
                &mut acts.logits,
                &mut acts.losses,
                &acts.targets,
                Some(dloss),
                n,
                vl,
                vl,
            )?;
        } else {
            vocab.cross_entropy_backward(&mut acts.logits, &acts.targets, &acts.stats, dloss)?;
        }
        // Head weight gradient and the partial gradient of ln_f's output.
        let sc = &mut acts.scratch;
        weft_kernels::zero(&mut sc.dln);
        matmul_backward_wt(
            &mut sc.dln,
            &mut g[head.clone()],
            None,
            &acts.logits,
            &acts.lnf,
            &p[head],
            s.b,
            s.t,
            c,
            vl,
            Mode::Throughput,
        )?;
        let dln = block.reduce_dln(&link, s, sc)?;
        weft_kernels::zero(&mut acts.dres);
        let (dlw, dlb) = g[lnf_r.clone()].split_at_mut(c);
        let last = &acts.layers[acts.layers.len() - 1].out;
        layernorm_backward(
            &mut acts.dres,
            dlw,
            dlb,
            dln,
            last,
            &p[lnf_r.start..lnf_r.start + c],
            &acts.lnf_mean,
            &acts.lnf_rstd,
            ns,
            c,
        )?;
        for l in (0..acts.layers.len()).rev() {
            let inp: &[f32] = if l == 0 {
                &acts.encoded
            } else {
                &acts.layers[l - 1].out
            };
            let r = blocks[l].clone();
            block.backward(
                &link,
                s,
                &mut acts.dres,
                &mut g[r.clone()],
                &acts.layers[l],
                inp,
                &p[r],
                &mut acts.scratch,
            )?;
        }
        // Embedding: the whole gradient (gathered under SP) into this
        // rank's wte rows and the replicated wpe.
        let dfull: &[f32] = if s.sp {
            link.all_gather(&acts.dres, &mut acts.scratch.dfull)?;
            &acts.scratch.dfull
        } else {
            &acts.dres
        };
        let (dwte, rest) = g.split_at_mut(wpe.start);
        vocab.embed_backward(
            dwte,
            Some(&mut rest[..wpe.len()]),
            dfull,
            &acts.tokens,
            s.t,
            c,
        )?;
        if s.sp {
            // Layernorm gradients are partial per rank under SP: one
            // all-reduce of all of them.
            let mut buf: Vec<f32> = ln_ranges
                .iter()
                .flat_map(|r| g[r.clone()].iter().copied())
                .collect();
            link.all_reduce(&mut buf)?;
            let mut at = 0;
            for r in ln_ranges {
                g[r.clone()].copy_from_slice(&buf[at..at + r.len()]);
                at += r.len();
            }
        }
        Ok(())
    }

    fn layernorm_ranges(&self) -> Vec<Range<usize>> {
        let mut rs = Vec::with_capacity(2 * self.config.n_layer + 1);
        for l in 0..self.config.n_layer {
            let base = self.block_range(l).start;
            for r in self.block.ln_ranges() {
                rs.push(base + r.start..base + r.end);
            }
        }
        rs.push(self.lnf_range());
        rs
    }

    /// One AdamW step over this rank's shard (`state` from
    /// [`adamw_state`](Self::adamw_state)), decaying the tensors whose
    /// [`TpTensor::decay`](super::TpTensor::decay) is set. Replicated
    /// tensors have bitwise identical gradients on every rank, so their
    /// replicas stay identical without communication.
    ///
    /// # Errors
    /// [`Error::Model`](super::Error::Model) naming the tensor if `state`
    /// was made for another layout (nothing is updated then).
    pub fn adamw_step(&mut self, state: &mut crate::AdamWState, hp: &AdamW) -> Result<()> {
        state
            .step(
                self.layout.tensors().iter().map(|t| (t.range(), t.decay)),
                &mut self.params,
                &self.grads,
                hp,
            )
            .map_err(crate::Error::from)?;
        Ok(())
    }

    /// Zero AdamW moments for this rank's shard.
    pub fn adamw_state(&self) -> crate::AdamWState {
        crate::AdamWState::zeros(self.params.len())
    }

    /// The squared L2 norm of the whole model's gradient (split tensors
    /// summed over the group, replicated ones counted once), the same on
    /// every rank — what gradient clipping needs.
    ///
    /// # Errors
    /// [`Error::Comm`](super::Error::Comm); [`Error::Shape`](super::Error::Shape)
    /// if `comm` is not this model's group.
    pub fn grad_norm_sq(&self, comm: &dyn Communicator) -> Result<f64> {
        self.link(comm)?;
        let (mut split, mut repl) = (0.0f64, 0.0f64);
        for t in self.layout.tensors() {
            let s: f64 = self.grads[t.range()]
                .iter()
                .map(|&x| f64::from(x) * f64::from(x))
                .sum();
            if t.split == super::Split::Replicated {
                repl += s;
            } else {
                split += s;
            }
        }
        let mut buf = [split];
        comm.all_reduce_with(&mut buf, &self.opts.sum())?;
        Ok(buf[0] + repl)
    }

    fn gather(&self, comm: &dyn Communicator, local: &[f32]) -> Result<Vec<f32>> {
        self.link(comm)?;
        let mut full = vec![0.0f32; self.full_layout.len()];
        for r in 0..self.tp() {
            let lay = TpLayout::new(&self.config, self.tp(), r)?;
            let mut buf = if r == self.rank() {
                local.to_vec()
            } else {
                vec![0.0f32; lay.len()]
            };
            comm.broadcast(&mut buf, r)?;
            lay.place(&buf, &self.full_layout, &mut full, r == 0)?;
        }
        Ok(full)
    }

    /// The whole model's parameters in [`ParamLayout`] order, on every rank
    /// (each rank broadcasts its shard; replicated tensors come from rank
    /// 0), for export: copy them into a [`Gpt`] and save it with
    /// [`crate::hf::save`].
    ///
    /// # Errors
    /// [`Error::Comm`](super::Error::Comm); [`Error::Shape`](super::Error::Shape)
    /// if `comm` is not this model's group.
    pub fn gather_params(&self, comm: &dyn Communicator) -> Result<Vec<f32>> {
        self.gather(comm, &self.params)
    }

    /// The whole model's gradients in [`ParamLayout`] order, on every rank.
    ///
    /// # Errors
    /// As [`gather_params`](Self::gather_params).
    pub fn gather_grads(&self, comm: &dyn Communicator) -> Result<Vec<f32>> {
        self.gather(comm, &self.grads)
    }

    /// Copies the gathered parameters into `gpt` (same configuration).
    ///
    /// # Errors
    /// As [`gather_params`](Self::gather_params); [`Error::Shape`](super::Error::Shape)
    /// if `gpt` has another layout.
    pub fn gather_into(&self, comm: &dyn Communicator, gpt: &mut Gpt) -> Result<()> {
        let full = self.gather_params(comm)?;
        check_len("model to export into", gpt.params.len(), full.len())?;
        gpt.params.copy_from_slice(&full);
        Ok(())
    }

    /// The checkpoint regions of a shard buffer (parameters, gradients or an
    /// AdamW moment, all in [`TpLayout`] order): for each tensor, each
    /// [`Piece`](super::Piece) of the global tensor this rank holds with its
    /// data, row-major — one distributed-checkpoint shard entry each (name,
    /// global shape, offsets, shape, bytes). Replicated tensors are included
    /// only when `replicated` is set (pass `rank == 0`, so that the regions
    /// of all ranks tile every tensor exactly once).
    ///
    /// # Errors
    /// [`Error::Shape`](super::Error::Shape) if `buf` is not a shard buffer
    /// of this layout.
    pub fn checkpoint_pieces<'a>(
        &'a self,
        buf: &[f32],
        replicated: bool,
    ) -> Result<Vec<(&'a super::TpTensor, super::Piece, Vec<f32>)>> {
        check_len("shard buffer", buf.len(), self.layout.len())?;
        let mut out = Vec::new();
        for t in self.layout.tensors() {
            if t.split == super::Split::Replicated && !replicated {
                continue;
            }
            for piece in t.pieces() {
                let data = t.piece_data(&buf[t.range()], &piece);
                out.push((t, piece, data));
            }
        }
        Ok(out)
    }

    /// The bytes the group sends (summed over its ranks) for one forward +
    /// backward of a `b×t` micro-batch with the ring algorithm and the
    /// plain (non-reproducible) sum, as counted by the collectives' traffic
    /// counters. With `k = tp`, `N = b·t`, `C`, `L` layers and 4-byte
    /// floats, a ring all-reduce of `x` floats sends `2(k−1)·4x` bytes in
    /// all, a reduce-scatter or all-gather `(k−1)·4x`:
    ///
    /// * without sequence parallelism: all-reduces of `N·C` floats — the
    ///   embedding (1), four per block (two forward, two backward), the
    ///   head's input gradient (1) — plus the cross-entropy's `N` maxima and
    ///   `2N` sums: `2(k−1)·4·((4L+2)·N·C + 3N)`;
    /// * with sequence parallelism each `N·C` all-reduce becomes a
    ///   reduce-scatter plus an all-gather of the same total bytes: the
    ///   embedding reduce-scatters forward and all-gathers backward; each
    ///   block all-gathers twice and reduce-scatters twice in each
    ///   direction; the head all-gathers `ln_f` forward and reduce-scatters
    ///   backward — `(4L+2)` of each, `(k−1)·4·(4L+2)·N·C` bytes each —
    ///   plus the cross-entropy's `3N` all-reduced floats and the
    ///   layernorm gradients' `2C(2L+1)` floats all-reduced once.
    ///
    /// (The reproducible mode sends encoded exact sums instead, about
    /// twice the bytes.)
    pub fn traffic_per_step(&self, b: usize, t: usize) -> TpTraffic {
        let k = self.tp() as u64 - 1;
        let (n, c, l) = (
            (b * t) as u64,
            self.config.n_embd as u64,
            self.config.n_layer as u64,
        );
        let big = (4 * l + 2) * n * c;
        let ce = 3 * n;
        if self.opts.sequence_parallel {
            TpTraffic {
                all_reduce: 2 * k * 4 * (ce + 2 * c * (2 * l + 1)),
                reduce_scatter: k * 4 * big,
                all_gather: k * 4 * big,
            }
        } else {
            TpTraffic {
                all_reduce: 2 * k * 4 * (big + ce),
                reduce_scatter: 0,
                all_gather: 0,
            }
        }
    }
}

/// Split parameter floats per rank and replicated floats of a GPT-2 split
/// `tp` ways — the accounting the trainer reports at start-up. The split
/// part is exactly `1/tp` of the unsplit one when `tp` divides the
/// vocabulary (else the first `V mod tp` ranks hold one embedding row
/// more).
///
/// # Errors
/// As [`TpLayout::new`].
pub fn param_split(cfg: &GptConfig, tp: usize, rank: usize) -> Result<(usize, usize)> {
    let l = TpLayout::new(cfg, tp, rank)?;
    Ok((l.split_len(), l.replicated_len()))
}
