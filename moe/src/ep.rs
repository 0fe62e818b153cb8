//! Expert parallelism: the experts of a [`MoeBlock`] sharded over an `ep`
//! group, tokens dispatched to the rank owning their expert and combined
//! back with `all_to_all_v`.
//!
//! Rank `r` of the group owns experts `r·E/ep .. (r+1)·E/ep`; the router and
//! the shared expert are replicated. Every rank routes its own tokens, then:
//!
//! 1. exchanges per-expert row counts (one `all_to_all_v`),
//! 2. sends each row of `x` to the rank owning its expert (rows sorted by
//!    expert, so each destination's rows are contiguous),
//! 3. runs each local expert once over every row it received, from all
//!    ranks (grouped, no padding),
//! 4. sends the outputs back the same way and combines them with the
//!    gates.
//!
//! The backward mirrors it: gate-weighted output gradients go out, input
//! gradients come back; each rank accumulates the gradients of its own
//! experts over every rank's tokens.
//!
//! Two ways to keep activations for the backward:
//! - [`forward`](ExpertParallel::forward) returns an [`EpSaved`] holding
//!   everything, including the rows this rank's experts received (their
//!   number varies from step to step);
//! - [`forward_flat`](ExpertParallel::forward_flat) writes a fixed
//!   [`saved_per_token`](ExpertParallel::saved_per_token) values per token
//!   into a caller-owned buffer (router logits, the expert outputs per
//!   slot, the shared expert's activations), as a model's activation
//!   planner needs, and [`backward_flat`](ExpertParallel::backward_flat)
//!   recomputes the experts' hidden activations: one more dispatch
//!   (`all_to_all_v` of the routed rows) and one more expert forward per
//!   backward, in exchange for not storing `2H` values per received row.
//!   Both give bitwise the same results.

use weft_collectives::{Communicator, CommunicatorExt, Element};
use weft_kernels::{Mode, Precision, Real, matmul_forward};

use crate::block::{
    MoeBlock, MoeConfig, MoeForward, combine, dot, expert_weights, expert_weights_mut, group,
    mlp_backward, mlp_forward,
};
use crate::error::{Error, Result, check};
use crate::stats::LoadStats;

/// What an expert-parallel forward saves for its backward.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EpSaved<T> {
    logits: Vec<T>,     // (N, E)
    slot_y: Vec<T>,     // (N*k, C)
    counts: Vec<usize>, // (ep, El): rows received from each rank per local expert
    x: Vec<T>,          // (R, C) received rows, grouped by local expert
    hpre: Vec<T>,       // (R, F): F = H, or 2H for SwiGLU
    act: Vec<T>,        // (R, H)
    shared: Vec<T>,     // (N, F_s + S) shared experts
}

/// A [`MoeBlock`] whose experts are sharded over an expert-parallel group
/// (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertParallel {
    block: MoeBlock,
    ep: usize,
    rank: usize,
}

impl ExpertParallel {
    /// Rank `rank` of an `ep`-way expert-parallel block.
    ///
    /// # Errors
    /// [`Error::Config`] if `ep` does not divide the number of experts or
    /// `rank >= ep`; as [`MoeConfig::validate`].
    pub fn new(cfg: MoeConfig, ep: usize, rank: usize) -> Result<Self> {
        let block = MoeBlock::new(cfg)?;
        let e = cfg.router.experts;
        if ep == 0 || !e.is_multiple_of(ep) || rank >= ep {
            return Err(Error::Config {
                field: "parallel.ep",
                reason: format!(
                    "is {ep} (rank {rank}); it must divide the number of experts ({e}) and exceed the rank"
                ),
            });
        }
        Ok(ExpertParallel { block, ep, rank })
    }

    /// Experts owned by each rank.
    #[must_use]
    pub fn local_experts(&self) -> usize {
        self.block.config().router.experts / self.ep
    }

    /// Length of this rank's parameter buffer
    /// (`config().tensors(local_experts())`).
    #[must_use]
    pub fn num_local_params(&self) -> usize {
        self.block.config().num_params(self.local_experts())
    }

    /// The block's configuration.
    #[must_use]
    pub fn config(&self) -> &MoeConfig {
        self.block.config()
    }

    /// This rank's block with its experts' products in `precision` (see
    /// [`MoeBlock::with_precision`]).
    #[must_use]
    pub fn with_precision(&self, precision: Precision) -> Self {
        ExpertParallel {
            block: self.block.with_precision(precision),
            ..self.clone()
        }
    }

    /// This rank's block for a backward of a loss scaled by `scale` (see
    /// [`MoeBlock::with_loss_scale`]).
    #[must_use]
    pub fn with_loss_scale(&self, scale: f64) -> Self {
        ExpertParallel {
            block: self.block.with_loss_scale(scale),
            ..self.clone()
        }
    }

    /// This rank's shard of a full (ep = 1) parameter buffer: the router,
    /// its experts and the shared expert.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] if `full` is not a full block's buffer.
    pub fn shard<T: Copy>(&self, full: &[T]) -> Result<Vec<T>> {
        let cfg = self.block.config();
        let e = cfg.router.experts;
        check("ep_shard", "full", full, cfg.num_params(e))?;
        let el = self.local_experts();
        let mut out = Vec::with_capacity(self.num_local_params());
        let mut off = 0;
        for t in cfg.tensors(e) {
            let n = t.numel();
            let src = &full[off..off + n];
            off += n;
            if t.name.starts_with("experts.") {
                let per = n / e;
                out.extend_from_slice(&src[self.rank * el * per..(self.rank + 1) * el * per]);
            } else {
                out.extend_from_slice(src);
            }
        }
        Ok(out)
    }

    fn check_comm<C: Communicator + ?Sized>(&self, comm: &C) -> Result<()> {
        if comm.size() != self.ep || comm.rank() != self.rank {
            return Err(Error::Config {
                field: "parallel.ep",
                reason: format!(
                    "block built for rank {} of {} but the communicator is rank {} of {}",
                    self.rank,
                    self.ep,
                    comm.rank(),
                    comm.size()
                ),
            });
        }
        Ok(())
    }

    /// Forward over this rank's `N = Σ seq_lens` tokens; `params` is this
    /// rank's shard ([`shard`](Self::shard) layout). Collective: every rank
    /// of `comm` must call it.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`], [`Error::Config`] for a communicator of
    /// the wrong size, [`Error::Comm`] if a collective fails.
    pub fn forward<T: Real + Element, C: Communicator + ?Sized>(
        &self,
        comm: &C,
        out: &mut [T],
        inp: &[T],
        params: &[T],
        seq_lens: &[usize],
    ) -> Result<(MoeForward, EpSaved<T>)> {
        const OP: &str = "ep_forward";
        self.check_comm(comm)?;
        let cfg = self.block.config();
        let (c, h, e, k) = (
            cfg.channels,
            cfg.hidden,
            cfg.router.experts,
            cfg.router.top_k,
        );
        let el = self.local_experts();
        let n: usize = seq_lens.iter().sum();
        check(OP, "inp", inp, n * c)?;
        check(OP, "out", out, n * c)?;
        check(OP, "params", params, self.num_local_params())?;
        let p = cfg.split(params, el);
        let mut logits = vec![<T as Real>::ZERO; n * e];
        matmul_forward(
            &mut logits,
            inp,
            p.router_w,
            None,
            1,
            n,
            c,
            e,
            Mode::Throughput,
            Precision::F32,
        )?;
        let routing = self.block.route(&logits, p.bias, seq_lens)?;
        let (order, offsets) = group(&routing);
        // Rows to send, in `order` (expert-major, so per rank contiguous).
        let mut send = vec![<T as Real>::ZERO; order.len() * c];
        for (r, &slot) in order.iter().enumerate() {
            let tok = slot / k;
            send[r * c..(r + 1) * c].copy_from_slice(&inp[tok * c..(tok + 1) * c]);
        }
        let (counts, recv_rows) = self.exchange_counts(comm, &offsets)?;
        let x_recv = self.dispatch(comm, &send, &offsets, &counts, c)?;
        let x = self.regroup(&x_recv, &counts, c, true);
        let rows = x.len() / c;
        let f = cfg.expert.fc(h);
        let mut hpre = vec![<T as Real>::ZERO; rows * f];
        let mut act = vec![<T as Real>::ZERO; rows * h];
        let mut y = vec![<T as Real>::ZERO; rows * c];
        let mut start = 0;
        for j in 0..el {
            let nj: usize = (0..self.ep).map(|s| counts[s * el + j]).sum();
            if nj > 0 {
                let w = expert_weights(&p, j, cfg);
                mlp_forward(
                    &mut y[start * c..(start + nj) * c],
                    &mut hpre[start * f..(start + nj) * f],
                    &mut act[start * h..(start + nj) * h],
                    &x[start * c..(start + nj) * c],
                    w,
                    nj,
                    c,
                    h,
                    cfg.expert,
                    self.block.precision,
                )?;
            }
            start += nj;
        }
        debug_assert_eq!(start, recv_rows);
        let y_back = self.regroup(&y, &counts, c, false);
        let y_mine = self.combine_back(comm, &y_back, &offsets, &counts, c)?;
        let mut slot_y = vec![<T as Real>::ZERO; n * k * c];
        for (r, &slot) in order.iter().enumerate() {
            slot_y[slot * c..(slot + 1) * c].copy_from_slice(&y_mine[r * c..(r + 1) * c]);
        }
        combine(out, &slot_y, &routing, c);
        let mut shared = Vec::new();
        if let Some(w) = p.shared {
            let s = cfg.shared_hidden();
            shared = vec![<T as Real>::ZERO; n * cfg.shared_saved_per_token()];
            let (sh, sa) = shared.split_at_mut(n * cfg.expert.fc(s));
            let mut ys = vec![<T as Real>::ZERO; n * c];
            mlp_forward(
                &mut ys,
                sh,
                sa,
                inp,
                w,
                n,
                c,
                s,
                cfg.expert,
                self.block.precision,
            )?;
            for (o, v) in out.iter_mut().zip(&ys) {
                *o += *v;
            }
        }
        let aux_loss = match cfg.aux {
            Some(aux) => aux.forward(&routing, seq_lens)?,
            None => 0.0,
        };
        Ok((
            MoeForward {
                stats: LoadStats::from_routing(&routing),
                aux_loss,
            },
            EpSaved {
                logits,
                slot_y,
                counts,
                x,
                hpre,
                act,
                shared,
            },
        ))
    }

    /// Backward of [`forward`](Self::forward): accumulates `dinp` and this
    /// rank's `dparams` (its experts' gradients summed over every rank's
    /// tokens; the router and shared expert over its own tokens only, to
    /// be all-reduced with data parallelism as usual). Collective.
    ///
    /// # Errors
    /// As [`forward`](Self::forward).
    #[allow(clippy::too_many_arguments)]
    pub fn backward<T: Real + Element, C: Communicator + ?Sized>(
        &self,
        comm: &C,
        dinp: &mut [T],
        dparams: &mut [T],
        dout: &[T],
        inp: &[T],
        saved: &EpSaved<T>,
        params: &[T],
        seq_lens: &[usize],
    ) -> Result<()> {
        const OP: &str = "ep_backward";
        self.check_comm(comm)?;
        let cfg = self.block.config();
        let (c, h, e, k) = (
            cfg.channels,
            cfg.hidden,
            cfg.router.experts,
            cfg.router.top_k,
        );
        let el = self.local_experts();
        let n: usize = seq_lens.iter().sum();
        check(OP, "inp", inp, n * c)?;
        check(OP, "dinp", dinp, n * c)?;
        check(OP, "dout", dout, n * c)?;
        check(OP, "params", params, self.num_local_params())?;
        check(OP, "dparams", dparams, self.num_local_params())?;
        check(OP, "saved.logits", &saved.logits, n * e)?;
        let p = cfg.split(params, el);
        let mut g = cfg.split_mut(dparams, el);
        let routing = self.block.route(&saved.logits, p.bias, seq_lens)?;
        let (order, offsets) = group(&routing);
        let mut dgate = vec![<T as Real>::ZERO; n * k];
        let mut send = vec![<T as Real>::ZERO; order.len() * c];
        for (r, &slot) in order.iter().enumerate() {
            let tok = slot / k;
            let d = &dout[tok * c..(tok + 1) * c];
            dgate[slot] = dot(d, &saved.slot_y[slot * c..(slot + 1) * c]);
            let gt = routing.gate[slot];
            for (s, &v) in send[r * c..(r + 1) * c].iter_mut().zip(d) {
                *s = gt * v;
            }
        }
        let counts = &saved.counts;
        let dy_recv = self.dispatch(comm, &send, &offsets, counts, c)?;
        let dy = self.regroup(&dy_recv, counts, c, true);
        let rows = dy.len() / c;
        let f = cfg.expert.fc(h);
        let mut dx = vec![<T as Real>::ZERO; rows * c];
        let mut start = 0;
        for j in 0..el {
            let nj: usize = (0..self.ep).map(|s| counts[s * el + j]).sum();
            if nj > 0 {
                let w = expert_weights(&p, j, cfg);
                let dw = expert_weights_mut(&mut g, j, cfg);
                mlp_backward(
                    &mut dx[start * c..(start + nj) * c],
                    dw,
                    &dy[start * c..(start + nj) * c],
                    &saved.x[start * c..(start + nj) * c],
                    &saved.hpre[start * f..(start + nj) * f],
                    &saved.act[start * h..(start + nj) * h],
                    w,
                    nj,
                    c,
                    h,
                    cfg.expert,
                    self.block.precision,
                )?;
            }
            start += nj;
        }
        let dx_back = self.regroup(&dx, counts, c, false);
        let dx_mine = self.combine_back(comm, &dx_back, &offsets, counts, c)?;
        for (r, &slot) in order.iter().enumerate() {
            let tok = slot / k;
            for (d, &v) in dinp[tok * c..(tok + 1) * c]
                .iter_mut()
                .zip(&dx_mine[r * c..(r + 1) * c])
            {
                *d += v;
            }
        }
        self.block.router_backward(
            dinp, g.router_w, &dgate, &routing, inp, p.router_w, seq_lens,
        )?;
        if let (Some(w), Some(dw)) = (p.shared, g.shared) {
            let s = cfg.shared_hidden();
            let (sh, sa) = saved.shared.split_at(n * cfg.expert.fc(s));
            mlp_backward(
                dinp,
                dw,
                dout,
                inp,
                sh,
                sa,
                w,
                n,
                c,
                s,
                cfg.expert,
                self.block.precision,
            )?;
        }
        Ok(())
    }

    /// Activation values per token that [`forward_flat`](Self::forward_flat)
    /// saves: router logits (E), each slot's expert output (k·C), then the
    /// shared experts' pre-activation and activation output (F_s + S, see
    /// [`MoeConfig::saved_per_token`]) if there are any.
    #[must_use]
    pub fn saved_per_token(&self) -> usize {
        let cfg = self.block.config();
        cfg.router.experts + cfg.router.top_k * cfg.channels + cfg.shared_saved_per_token()
    }

    /// [`forward`](Self::forward) keeping its activations in
    /// `saved (N, saved_per_token)` instead of an [`EpSaved`] (see the
    /// module docs). Collective.
    ///
    /// # Errors
    /// As [`forward`](Self::forward), and [`Error::ShapeMismatch`] for
    /// `saved`.
    pub fn forward_flat<T: Real + Element, C: Communicator + ?Sized>(
        &self,
        comm: &C,
        out: &mut [T],
        saved: &mut [T],
        inp: &[T],
        params: &[T],
        seq_lens: &[usize],
    ) -> Result<MoeForward> {
        let n: usize = seq_lens.iter().sum();
        check("ep_forward", "saved", saved, n * self.saved_per_token())?;
        let (fwd, full) = self.forward(comm, out, inp, params, seq_lens)?;
        let (a, rest) = saved.split_at_mut(full.logits.len());
        let (b, c) = rest.split_at_mut(full.slot_y.len());
        a.copy_from_slice(&full.logits);
        b.copy_from_slice(&full.slot_y);
        c.copy_from_slice(&full.shared);
        Ok(fwd)
    }

    /// Backward of [`forward_flat`](Self::forward_flat): recomputes the
    /// experts' hidden activations (one dispatch and one expert forward),
    /// then proceeds as [`backward`](Self::backward), with the same
    /// gradients. Collective.
    ///
    /// # Errors
    /// As [`backward`](Self::backward), and [`Error::ShapeMismatch`] for
    /// `saved`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_flat<T: Real + Element, C: Communicator + ?Sized>(
        &self,
        comm: &C,
        dinp: &mut [T],
        dparams: &mut [T],
        dout: &[T],
        inp: &[T],
        saved: &[T],
        params: &[T],
        seq_lens: &[usize],
    ) -> Result<()> {
        const OP: &str = "ep_backward";
        self.check_comm(comm)?;
        let cfg = self.block.config();
        let (c, h, e, k) = (
            cfg.channels,
            cfg.hidden,
            cfg.router.experts,
            cfg.router.top_k,
        );
        let el = self.local_experts();
        let n: usize = seq_lens.iter().sum();
        check(OP, "inp", inp, n * c)?;
        check(OP, "saved", saved, n * self.saved_per_token())?;
        check(OP, "params", params, self.num_local_params())?;
        let (logits, rest) = saved.split_at(n * e);
        let (slot_y, shared) = rest.split_at(n * k * c);
        let p = cfg.split(params, el);
        let routing = self.block.route(logits, p.bias, seq_lens)?;
        let (order, offsets) = group(&routing);
        let mut send = vec![<T as Real>::ZERO; order.len() * c];
        for (r, &slot) in order.iter().enumerate() {
            let tok = slot / k;
            send[r * c..(r + 1) * c].copy_from_slice(&inp[tok * c..(tok + 1) * c]);
        }
        let (counts, _) = self.exchange_counts(comm, &offsets)?;
        let x_recv = self.dispatch(comm, &send, &offsets, &counts, c)?;
        let x = self.regroup(&x_recv, &counts, c, true);
        let rows = x.len() / c;
        let f = cfg.expert.fc(h);
        let mut hpre = vec![<T as Real>::ZERO; rows * f];
        let mut act = vec![<T as Real>::ZERO; rows * h];
        let mut y = vec![<T as Real>::ZERO; rows * c];
        let mut start = 0;
        for j in 0..el {
            let nj: usize = (0..self.ep).map(|s| counts[s * el + j]).sum();
            if nj > 0 {
                mlp_forward(
                    &mut y[start * c..(start + nj) * c],
                    &mut hpre[start * f..(start + nj) * f],
                    &mut act[start * h..(start + nj) * h],
                    &x[start * c..(start + nj) * c],
                    expert_weights(&p, j, cfg),
                    nj,
                    c,
                    h,
                    cfg.expert,
                    self.block.precision,
                )?;
            }
            start += nj;
        }
        let full = EpSaved {
            logits: logits.to_vec(),
            slot_y: slot_y.to_vec(),
            counts,
            x,
            hpre,
            act,
            shared: shared.to_vec(),
        };
        self.backward(comm, dinp, dparams, dout, inp, &full, params, seq_lens)
    }

    /// Sends each rank the row counts of its experts; returns
    /// `counts (ep, El)` received and their total.
    fn exchange_counts<C: Communicator + ?Sized>(
        &self,
        comm: &C,
        offsets: &[usize],
    ) -> Result<(Vec<usize>, usize)> {
        let (e, el) = (offsets.len() - 1, self.local_experts());
        #[allow(clippy::cast_precision_loss)]
        let send: Vec<f64> = (0..e)
            .map(|j| (offsets[j + 1] - offsets[j]) as f64)
            .collect();
        let mut recv = vec![0.0f64; el * self.ep];
        let per = vec![el; self.ep];
        comm.all_to_all_v(&send, &per, &mut recv, &per)?;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let counts: Vec<usize> = recv.iter().map(|&x| x as usize).collect();
        let total = counts.iter().sum();
        Ok((counts, total))
    }

    /// Rows (in `order`) to their expert's rank; returns the received rows
    /// (source-major, expert-major within a source).
    fn dispatch<T: Element, C: Communicator + ?Sized>(
        &self,
        comm: &C,
        send: &[T],
        offsets: &[usize],
        counts: &[usize],
        c: usize,
    ) -> Result<Vec<T>> {
        let el = self.local_experts();
        let send_counts: Vec<usize> = (0..self.ep)
            .map(|r| (offsets[(r + 1) * el] - offsets[r * el]) * c)
            .collect();
        let recv_counts: Vec<usize> = (0..self.ep)
            .map(|s| counts[s * el..(s + 1) * el].iter().sum::<usize>() * c)
            .collect();
        let mut recv = vec![T::ZERO; recv_counts.iter().sum()];
        comm.all_to_all_v(send, &send_counts, &mut recv, &recv_counts)?;
        Ok(recv)
    }

    /// The reverse of [`dispatch`](Self::dispatch): rows in received order
    /// back to their sources; returns this rank's rows in `order`.
    fn combine_back<T: Element, C: Communicator + ?Sized>(
        &self,
        comm: &C,
        send: &[T],
        offsets: &[usize],
        counts: &[usize],
        c: usize,
    ) -> Result<Vec<T>> {
        let el = self.local_experts();
        let send_counts: Vec<usize> = (0..self.ep)
            .map(|s| counts[s * el..(s + 1) * el].iter().sum::<usize>() * c)
            .collect();
        let recv_counts: Vec<usize> = (0..self.ep)
            .map(|r| (offsets[(r + 1) * el] - offsets[r * el]) * c)
            .collect();
        let mut recv = vec![T::ZERO; recv_counts.iter().sum()];
        comm.all_to_all_v(send, &send_counts, &mut recv, &recv_counts)?;
        Ok(recv)
    }

    /// Reorders received rows between source-major (as received) and
    /// expert-major (as computed); `to_expert` picks the direction.
    fn regroup<T: Copy + Default>(
        &self,
        rows: &[T],
        counts: &[usize],
        c: usize,
        to_expert: bool,
    ) -> Vec<T> {
        let (ep, el) = (self.ep, self.local_experts());
        // Start of block (s, j) in source-major and expert-major layouts.
        let mut src_start = vec![0usize; ep * el];
        let mut acc = 0;
        for (i, &n) in counts.iter().enumerate() {
            src_start[i] = acc;
            acc += n;
        }
        let mut out = vec![T::default(); rows.len()];
        let mut exp_acc = 0;
        for j in 0..el {
            for s in 0..ep {
                let n = counts[s * el + j];
                let a = src_start[s * el + j] * c;
                let b = exp_acc * c;
                if to_expert {
                    out[b..b + n * c].copy_from_slice(&rows[a..a + n * c]);
                } else {
                    out[a..a + n * c].copy_from_slice(&rows[b..b + n * c]);
                }
                exp_acc += n;
            }
        }
        out
    }
}
