//! Multi-rank runs: ranks are threads of this process, talking through
//! `weft-collectives`' local backend.
//!
//! Every rank runs the same training loop (SPMD, as torchtitan does); the
//! ranks differ only in which micro-batches they compute and in how their
//! gradients are combined. Rank 0 alone writes the run folder and reports
//! to the [`Observer`]: its reports cross to the calling thread over a
//! channel, so the terminal observer never leaves the main thread.
//!
//! # Data parallelism and bitwise reproducibility
//! A step's global batch is `train.grad_accum` micro-batches whatever the
//! split; with `parallel.dp = N` rank r computes micro-batches
//! `r·M/N .. (r+1)·M/N`. With `parallel.reproducible` on (the default) a
//! rank does not add its micro-batch gradients in f32: it folds each into
//! an exact, mergeable partial sum ([`weft_collectives::repro::ExactPartial`]),
//! the ranks reduce their partials exactly
//! ([`CommunicatorExt::all_reduce_exact`]), and the mean is rounded once. The
//! gradient — and so every later parameter — has the same bits for any
//! `dp` that divides `grad_accum`, including the single-rank run. Losses are
//! gathered per micro-batch and summed in micro-batch order, as the single
//! rank sums them. With `reproducible` off gradients are summed in f32
//! where they land and all-reduced with the ring: faster, and equal only to
//! rounding.

use std::ops::Range;
use std::sync::mpsc;

use weft_collectives::{Communicator, CommunicatorExt, ReduceOp, repro};

use crate::train::{EvalReport, HealthEvent, Observer, RunInfo, StepReport, Summary, TrainError};

/// An observer report crossing from rank 0 to the calling thread.
pub(crate) enum Report {
    Start(RunInfo),
    Step(StepReport),
    Eval(EvalReport),
    Event(HealthEvent),
    Resumed(u64, Vec<String>),
    Finish(Summary),
}

impl Report {
    /// Hands the report to `observer`.
    pub(crate) fn deliver(self, observer: &mut dyn Observer) {
        match self {
            Report::Start(i) => observer.start(&i),
            Report::Step(s) => observer.step(&s),
            Report::Eval(e) => observer.eval(&e),
            Report::Event(e) => observer.event(&e),
            Report::Resumed(step, skipped) => observer.resumed(step, &skipped),
            Report::Finish(s) => observer.finish(&s),
        }
    }
}

/// Rank 0's observer: forwards every report over a channel. A closed
/// channel (the receiver gave up) drops reports silently.
pub(crate) struct Forward(pub(crate) mpsc::Sender<Report>);

impl Observer for Forward {
    fn start(&mut self, info: &RunInfo) {
        let _ = self.0.send(Report::Start(info.clone()));
    }
    fn step(&mut self, report: &StepReport) {
        let _ = self.0.send(Report::Step(*report));
    }
    fn eval(&mut self, report: &EvalReport) {
        let _ = self.0.send(Report::Eval(*report));
    }
    fn event(&mut self, event: &HealthEvent) {
        let _ = self.0.send(Report::Event(event.clone()));
    }
    fn resumed(&mut self, step: u64, skipped: &[String]) {
        let _ = self.0.send(Report::Resumed(step, skipped.to_vec()));
    }
    fn finish(&mut self, summary: &Summary) {
        let _ = self.0.send(Report::Finish(summary.clone()));
    }
}

/// The data-parallel group of one rank.
pub(crate) struct Dp {
    comm: Box<dyn Communicator>,
}

impl Dp {
    /// The group over `comm`.
    pub(crate) fn new(comm: Box<dyn Communicator>) -> Self {
        Self { comm }
    }

    /// This rank's index in the group.
    pub(crate) fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the group.
    pub(crate) fn size(&self) -> usize {
        self.comm.size()
    }

    /// The micro-batches (of `total`) this rank computes.
    pub(crate) fn share(&self, total: usize) -> Range<usize> {
        let per = total / self.size();
        self.rank() * per..(self.rank() + 1) * per
    }

    /// Every rank's `local` values, concatenated in rank order (all ranks
    /// pass the same length).
    pub(crate) fn gather(&self, local: &[f64]) -> Result<Vec<f64>, TrainError> {
        let mut all = vec![0.0; local.len() * self.size()];
        self.comm.all_gather(local, &mut all)?;
        Ok(all)
    }

    /// Elementwise sum over ranks of small integer-valued counts (exact
    /// below 2^53 whatever the order).
    pub(crate) fn sum_counts(&self, values: &mut [f64]) -> Result<(), TrainError> {
        self.comm.all_reduce(values, ReduceOp::Sum)?;
        Ok(())
    }

    /// Plain f32 sum of `grads` over the group (ring or the policy's pick).
    pub(crate) fn sum_f32(&self, grads: &mut [f32]) -> Result<(), TrainError> {
        self.comm.all_reduce(grads, ReduceOp::Sum)?;
        Ok(())
    }
}

/// Sums micro-batch gradients: exactly (order- and split-independent) or
/// in place in f32.
pub(crate) struct GradAccum {
    /// The exact partial sum (reproducible mode).
    exact: Option<repro::ExactPartial>,
}

impl GradAccum {
    /// An empty accumulator for `len` gradients; `exact` selects the
    /// reproducible sum.
    pub(crate) fn new(len: usize, exact: bool) -> Self {
        Self {
            exact: exact.then(|| repro::ExactPartial::new(len)),
        }
    }

    /// Call after each micro-batch's backward. Exact: folds `grads` into
    /// the partial and zeroes them for the next micro-batch. Plain: leaves
    /// them to accumulate in place.
    pub(crate) fn add(&mut self, grads: &mut [f32]) -> Result<(), TrainError> {
        if let Some(partial) = &mut self.exact {
            partial.add(grads)?;
            grads.fill(0.0);
        }
        Ok(())
    }

    /// Writes the mean over the `micro_batches` of the global batch — this
    /// rank's, and with `dp` the whole group's — into `grads`, and resets
    /// the accumulator. Exact: the exact sum divided by the count, rounded
    /// once; plain: the f32 sum (all-reduced over `dp`) times
    /// `1/micro_batches`.
    pub(crate) fn finish(
        &mut self,
        grads: &mut [f32],
        dp: Option<&Dp>,
        micro_batches: usize,
    ) -> Result<(), TrainError> {
        match &mut self.exact {
            Some(partial) => {
                match dp {
                    Some(dp) => dp.comm.all_reduce_exact(partial, grads, ReduceOp::Avg)?,
                    None => partial.mean_to(grads)?,
                }
                partial.clear();
            }
            None => {
                if let Some(dp) = dp {
                    dp.sum_f32(grads)?;
                }
                if micro_batches > 1 {
                    let inv = 1.0 / micro_batches as f32;
                    grads.iter_mut().for_each(|g| *g *= inv);
                }
            }
        }
        Ok(())
    }
}
