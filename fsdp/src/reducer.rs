//! The gradient reducer: one worker thread that runs every gradient
//! reduction of this rank in the order they were submitted.
//!
//! Gradients of a unit are ready at different moments of the backward; each
//! is handed to the worker as soon as it is, and the worker reduces it
//! while the training thread computes the next unit's backward. The worker
//! owns its own communicators (split off the data-parallel group at
//! construction), and is the only thread that issues collectives on them,
//! so every rank issues them in the same order.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Instant;

use weft_collectives::repro::ExactPartial;
use weft_collectives::{Communicator, ReduceOp, ReduceOptions};

use crate::error::{Error, Result, comm};
use crate::exact::{self, ExactBuf};
use crate::lowp::LowVec;

/// Gradients handed to the worker.
#[derive(Debug)]
pub(crate) enum GradIn {
    /// Rounded values (the reduce dtype) of the whole padded unit.
    Plain(LowVec),
    /// An exact partial of the whole padded unit, one chunk per shard rank
    /// (reduced to an exact partial of this rank's shard).
    Exact(ExactBuf),
    /// An exact partial of the whole padded unit, reduced, divided by the
    /// step's micro-batch count (the second field) and rounded once by the
    /// collectives' `reduce_scatter_exact_div`.
    Partial(ExactPartial, u64),
}

/// What a reduction produced.
#[derive(Debug)]
pub(crate) enum GradOut {
    /// Rounded values of the shard; `true` if already the mean over every
    /// contribution.
    Plain(LowVec, bool),
    /// The exact sum over the group (and replicas) of this rank's chunk.
    Exact(ExactBuf),
}

/// One reduction: a reduce-scatter of a unit's gradients over the shard
/// group, then (hybrid) an all-reduce of the shard over the replicas.
#[derive(Debug)]
struct Job {
    unit: usize,
    micro: usize,
    data: GradIn,
}

/// A finished reduction.
#[derive(Debug)]
pub(crate) struct Done {
    pub unit: usize,
    pub micro: usize,
    pub result: Result<GradOut>,
    pub start: Instant,
    pub end: Instant,
}

/// Handle to the worker.
#[derive(Debug)]
pub(crate) struct Reducer {
    tx: Option<Sender<Job>>,
    rx: Receiver<Done>,
    worker: Option<JoinHandle<()>>,
    pending: usize,
}

/// The worker's communicators and options.
pub(crate) struct Groups {
    pub shard: Arc<dyn Communicator>,
    pub replicas: Option<Arc<dyn Communicator>>,
    pub opts: ReduceOptions,
}

impl Reducer {
    pub(crate) fn start(groups: Groups) -> Result<Self> {
        let (tx, jobs) = channel::<Job>();
        let (done, rx) = channel::<Done>();
        let worker = std::thread::Builder::new()
            .name("weft-fsdp-reduce".into())
            .spawn(move || {
                while let Ok(job) = jobs.recv() {
                    let start = Instant::now();
                    let result = run(&groups, job.data, job.unit);
                    let end = Instant::now();
                    let failed = result.is_err();
                    let sent = done.send(Done {
                        unit: job.unit,
                        micro: job.micro,
                        result,
                        start,
                        end,
                    });
                    if sent.is_err() || failed {
                        break;
                    }
                }
            })
            .map_err(|e| Error::Config {
                field: "reducer",
                reason: format!("cannot spawn the gradient reducer thread: {e}"),
            })?;
        Ok(Reducer {
            tx: Some(tx),
            rx,
            worker: Some(worker),
            pending: 0,
        })
    }

    /// Queues a reduction.
    ///
    /// # Errors
    /// The error that stopped the worker, if it has stopped.
    pub(crate) fn submit(&mut self, unit: usize, micro: usize, data: GradIn) -> Result<()> {
        let job = Job { unit, micro, data };
        match &self.tx {
            Some(tx) if tx.send(job).is_ok() => {
                self.pending += 1;
                Ok(())
            }
            _ => Err(self.stopped()),
        }
    }

    /// Why the worker stopped: the first failed reduction not yet received.
    fn stopped(&mut self) -> Error {
        self.tx = None;
        while let Ok(d) = self.rx.try_recv() {
            self.pending = self.pending.saturating_sub(1);
            if let Err(e) = d.result {
                return e;
            }
        }
        Error::Config {
            field: "reducer",
            reason: "the gradient reducer stopped after an earlier error".into(),
        }
    }

    /// Reductions submitted and not yet received.
    pub(crate) fn pending(&self) -> usize {
        self.pending
    }

    /// A finished reduction if one is ready.
    pub(crate) fn try_next(&mut self) -> Option<Done> {
        let d = self.rx.try_recv().ok()?;
        self.pending -= 1;
        Some(d)
    }

    /// Waits for the next finished reduction.
    pub(crate) fn next(&mut self) -> Result<Done> {
        let d = self.rx.recv().map_err(|_| Error::Config {
            field: "reducer",
            reason: "the gradient reducer thread ended unexpectedly".into(),
        })?;
        self.pending -= 1;
        Ok(d)
    }
}

impl Drop for Reducer {
    fn drop(&mut self) {
        self.tx = None; // ends the worker's loop
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

fn run(g: &Groups, data: GradIn, unit: usize) -> Result<GradOut> {
    let n = g.shard.size();
    match data {
        GradIn::Plain(v) => {
            let len = v.len() / n;
            let mut out = v.zeros_like(len);
            v.reduce_scatter(&*g.shard, &mut out, &g.opts)
                .map_err(comm(format!("reduce_scatter of unit {unit}")))?;
            if let Some(rep) = &g.replicas {
                out.all_reduce(&**rep, &g.opts)
                    .map_err(comm(format!("all_reduce across replicas of unit {unit}")))?;
            }
            Ok(GradOut::Plain(out, false))
        }
        GradIn::Exact(x) => {
            let mine =
                exact::reduce_scatter(&*g.shard, &x, &format!("reduce_scatter of unit {unit}"))?;
            drop(x);
            let mine = match &g.replicas {
                Some(rep) => exact::all_merge(
                    &**rep,
                    &mine,
                    &format!("all_reduce across replicas of unit {unit}"),
                )?,
                None => mine,
            };
            Ok(GradOut::Exact(mine))
        }
        GradIn::Partial(p, divisor) => {
            if g.replicas.is_some() {
                // rounded shards cannot be summed across replicas exactly
                return Err(Error::Config {
                    field: "reducer",
                    reason: "hybrid sharding reduces exact shard partials, not rounded shards"
                        .into(),
                });
            }
            let mut out = LowVec::zeros(g.opts.wire, p.len() / n);
            out.reduce_scatter_exact_div(&*g.shard, &p, divisor)
                .map_err(comm(format!("reduce_scatter of unit {unit}")))?;
            Ok(GradOut::Plain(out, true))
        }
    }
}

/// The reduce options for a dtype: sum, no narrower wire.
pub(crate) fn options(
    algorithm: weft_collectives::Algorithm,
    reduce: weft_collectives::Dtype,
) -> ReduceOptions {
    ReduceOptions::new(ReduceOp::Sum)
        .algorithm(algorithm)
        .wire(reduce)
}

/// Makes `Send`-checking explicit for the worker's captured state.
const _: fn() = || {
    fn is_send<T: Send>() {}
    is_send::<Groups>();
    is_send::<Job>();
    is_send::<Done>();
};
