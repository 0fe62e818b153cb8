//! One rank's model: the whole GPT (whose mixture-of-experts blocks may
//! hold a share of the experts), or its tensor-parallel shard.
//!
//! The training loop talks to a [`Net`] only: forward, backward, the
//! gradient buffer, the squared gradient norm of the whole model, the AdamW
//! step, and assembling the whole model for a checkpoint.

use weft_collectives::{Communicator, CommunicatorExt};
use weft_kernels::AdamW;
use weft_model::tp::{TpActivations, TpGpt, TpLayout};
use weft_model::{Activations, AdamWState, Gpt, ParamLayout};

use crate::parallel::Dp;
use crate::train::TrainError;

/// One rank's model.
pub(crate) enum Net {
    /// The whole model (experts possibly sharded over an expert group).
    Whole(Gpt),
    /// This rank's tensor-parallel shard.
    Tp(TpGpt),
}

/// Activation buffers for a [`Net`].
pub(crate) enum NetActs {
    /// For [`Net::Whole`].
    Whole(Activations),
    /// For [`Net::Tp`], with the batch size they were planned for.
    Tp(TpActivations, usize),
}

impl NetActs {
    /// Bytes of activations planned.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            NetActs::Whole(a) => a.bytes(),
            NetActs::Tp(a, _) => a.bytes(),
        }
    }

    /// Sequences the buffers were planned for.
    pub(crate) fn batch(&self) -> usize {
        match self {
            NetActs::Whole(a) => a.batch(),
            NetActs::Tp(_, b) => *b,
        }
    }
}

fn tp_err(e: weft_model::tp::Error) -> TrainError {
    TrainError::TensorParallel(e)
}

/// The tensor-parallel group, which a [`Net::Tp`] needs.
fn tp_comm(dp: Option<&Dp>) -> Result<&dyn Communicator, TrainError> {
    dp.and_then(Dp::tp)
        .ok_or_else(|| TrainError::Unsupported("a tensor-parallel model needs its tp group".into()))
}

impl Net {
    /// Activation buffers for micro-batches of `b` sequences of `t` tokens.
    pub(crate) fn activations(&self, b: usize, t: usize) -> Result<NetActs, TrainError> {
        Ok(match self {
            Net::Whole(m) => NetActs::Whole(m.activations(b, t)?),
            Net::Tp(m) => NetActs::Tp(m.activations(b, t).map_err(tp_err)?, b),
        })
    }

    /// Forward over one batch; the mean loss with `targets`.
    pub(crate) fn forward(
        &self,
        dp: Option<&Dp>,
        acts: &mut NetActs,
        tokens: &[u32],
        targets: Option<&[u32]>,
    ) -> Result<Option<f64>, TrainError> {
        match (self, acts) {
            (Net::Whole(m), NetActs::Whole(a)) => Ok(m.forward(a, tokens, targets)?),
            (Net::Tp(m), NetActs::Tp(a, _)) => {
                m.forward(tp_comm(dp)?, a, tokens, targets).map_err(tp_err)
            }
            _ => Err(TrainError::Unsupported(
                "activations planned for another model".into(),
            )),
        }
    }

    /// Backward of the last forward, accumulating into the gradients.
    pub(crate) fn backward(
        &mut self,
        dp: Option<&Dp>,
        acts: &mut NetActs,
    ) -> Result<(), TrainError> {
        match (self, acts) {
            (Net::Whole(m), NetActs::Whole(a)) => Ok(m.backward(a)?),
            (Net::Tp(m), NetActs::Tp(a, _)) => m.backward(tp_comm(dp)?, a).map_err(tp_err),
            _ => Err(TrainError::Unsupported(
                "activations planned for another model".into(),
            )),
        }
    }

    /// Sets every gradient to zero.
    pub(crate) fn zero_grad(&mut self) {
        match self {
            Net::Whole(m) => m.zero_grad(),
            Net::Tp(m) => m.zero_grad(),
        }
    }

    /// Parameters on this rank.
    pub(crate) fn params_len(&self) -> usize {
        match self {
            Net::Whole(m) => m.params.len(),
            Net::Tp(m) => m.params.len(),
        }
    }

    /// This rank's gradient buffer.
    pub(crate) fn grads(&self) -> &[f32] {
        match self {
            Net::Whole(m) => &m.grads,
            Net::Tp(m) => &m.grads,
        }
    }

    /// This rank's gradient buffer, mutably.
    pub(crate) fn grads_mut(&mut self) -> &mut [f32] {
        match self {
            Net::Whole(m) => &mut m.grads,
            Net::Tp(m) => &mut m.grads,
        }
    }

    /// Zero AdamW moments for this rank's parameters.
    pub(crate) fn adamw_state(&self) -> AdamWState {
        match self {
            Net::Whole(m) => AdamWState::new(m),
            Net::Tp(m) => m.adamw_state(),
        }
    }

    /// One AdamW step on this rank's parameters.
    pub(crate) fn adamw_step(
        &mut self,
        opt: &mut AdamWState,
        hp: &AdamW,
    ) -> Result<(), TrainError> {
        match self {
            Net::Whole(m) => Ok(m.adamw_step(opt, hp)?),
            Net::Tp(m) => m.adamw_step(opt, hp).map_err(tp_err),
        }
    }

    /// The squared L2 norm of the whole model's gradient, the same on every
    /// rank: tensor-parallel shards summed over the tp group and expert
    /// shards over the expert group, replicated tensors counted once.
    pub(crate) fn grad_norm_sq(&self, dp: Option<&Dp>) -> Result<f64, TrainError> {
        match self {
            Net::Tp(m) => m.grad_norm_sq(tp_comm(dp)?).map_err(tp_err),
            Net::Whole(m) => match dp {
                Some(d) if d.ep().is_some() => {
                    let (mut dense, mut experts) = (0.0, 0.0);
                    for spec in m.layout().specs() {
                        let sq: f64 = m.grads[spec.range()]
                            .iter()
                            .map(|&g| f64::from(g) * f64::from(g))
                            .sum();
                        if weft_model::MoeFfn::is_expert_param(&spec.name) {
                            experts += sq;
                        } else {
                            dense += sq;
                        }
                    }
                    Ok(dense + d.sum_over_experts(experts)?)
                }
                _ => Ok(m
                    .grads
                    .iter()
                    .map(|&g| f64::from(g) * f64::from(g))
                    .sum::<f64>()),
            },
        }
    }

    /// Copies the whole model's state, `whole` and `whole_opt` (laid out by
    /// their [`ParamLayout`]), into this rank's share: its experts, or its
    /// tensor-parallel shard.
    pub(crate) fn take_share(
        &mut self,
        dp: Option<&Dp>,
        whole: &Gpt,
        whole_opt: &AdamWState,
        opt: &mut AdamWState,
    ) -> Result<(), TrainError> {
        opt.step = whole_opt.step;
        match self {
            Net::Whole(m) => {
                let ep_rank = dp.and_then(Dp::ep_rank).unwrap_or(0);
                let (fl, ll) = (whole.layout().clone(), m.layout().clone());
                crate::parallel::take_experts(&fl, &whole.params, &ll, &mut m.params, ep_rank);
                crate::parallel::take_experts(&fl, &whole_opt.m, &ll, &mut opt.m, ep_rank);
                crate::parallel::take_experts(&fl, &whole_opt.v, &ll, &mut opt.v, ep_rank);
                Ok(())
            }
            Net::Tp(m) => {
                let lay = m.layout().clone();
                let fl = whole.layout();
                m.load_full(&whole.params).map_err(tp_err)?;
                opt.m = lay.shard(fl, &whole_opt.m).map_err(tp_err)?;
                opt.v = lay.shard(fl, &whole_opt.v).map_err(tp_err)?;
                Ok(())
            }
        }
    }

    /// Assembles the whole model's parameters and moments into `whole` and
    /// `whole_opt` (on ranks that keep them; `None` elsewhere). Collective
    /// over the expert or tp group: every rank of the group calls it.
    pub(crate) fn assemble(
        &self,
        dp: Option<&Dp>,
        opt: &AdamWState,
        full_layout: &ParamLayout,
        whole: Option<(&mut Gpt, &mut AdamWState)>,
    ) -> Result<(), TrainError> {
        let (mut p, mut mo, mut vo) = (None, None, None);
        if let Some((g, o)) = whole {
            o.step = opt.step;
            p = Some(&mut g.params[..]);
            mo = Some(&mut o.m[..]);
            vo = Some(&mut o.v[..]);
        }
        match self {
            Net::Whole(m) => {
                let d = dp.ok_or_else(|| TrainError::Unsupported("no groups".into()))?;
                let ll = m.layout();
                d.gather_experts(ll, full_layout, &m.params, p)?;
                d.gather_experts(ll, full_layout, &opt.m, mo)?;
                d.gather_experts(ll, full_layout, &opt.v, vo)
            }
            Net::Tp(m) => {
                let comm = tp_comm(dp)?;
                for (local, out) in [(&m.params[..], p), (&opt.m[..], mo), (&opt.v[..], vo)] {
                    gather_tp(comm, m, local, full_layout, out)?;
                }
                Ok(())
            }
        }
    }
}

/// Gathers a tensor-parallel shard buffer (parameters or a moment) of
/// every rank of the tp group into the whole-model buffer `out` (on ranks
/// that pass one): each rank broadcasts its shard in turn.
fn gather_tp(
    comm: &dyn Communicator,
    m: &TpGpt,
    local: &[f32],
    full_layout: &ParamLayout,
    mut out: Option<&mut [f32]>,
) -> Result<(), TrainError> {
    for r in 0..m.tp() {
        let lay = TpLayout::new(m.config(), m.tp(), r).map_err(tp_err)?;
        let mut buf = if r == m.rank() {
            local.to_vec()
        } else {
            vec![0.0f32; lay.len()]
        };
        comm.broadcast(&mut buf, r)?;
        if let Some(o) = out.as_deref_mut() {
            lay.place(&buf, full_layout, o, r == 0).map_err(tp_err)?;
        }
    }
    Ok(())
}
