//! The gradient reducer: one worker thread that runs every gradient
//! reduction of this rank in the order they were submitted.
//!
//! Gradients of a unit are ready at different moments of the backward; each
//! is handed to the worker as soon as it is, and the worker reduces it
//! while the training thread computes the next unit's backward. The worker
//! owns its own communicators (split off the data-parallel group at
//! construction), and is the only thread that issues collectives on them,
//! so every rank issues them in the same order.

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
    /// An exact partial of the whole padded unit, reduced and rounded once
    /// by the collectives' `reduce_scatter_exact` / `all_reduce_exact`.
    Partial(ExactPartial),
}

/// What a reduction produced.
#[derive(Debug)]
pub(crate) enum GradOut {
    /// Rounded values: the shard (reduce-scatter) or the whole unit
    /// (all-reduce); `true` if already the mean over every contribution.
    Plain(LowVec, bool),
    /// The exact sum over the group (and replicas) of this rank's chunk.
    Exact(ExactBuf),
}

/// Which reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Reduce-scatter over the shard group, then (hybrid) all-reduce of the
    /// shard over the replicas.
    Scatter,
    /// All-reduce of the whole unit (no sharding).
    AllReduce,
}

#[derive(Debug)]
struct Job {
    unit: usize,
    micro: usize,
    kind: Kind,
    data: GradIn,
}

/// A finished reduction.
#[derive(Debug)]
pub(crate) struct Done {
    pub unit: usize,
    pub micro: usize,
    pub kind: Kind,
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
    pub shard: Box<dyn Communicator>,
    pub replicas: Option<Box<dyn Communicator>>,
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
                    let result = run(&groups, job.kind, job.data, job.unit);
                    let end = Instant::now();
                    let failed = result.is_err();
                    let sent = done.send(Done {
                        unit: job.unit,
                        micro: job.micro,
                        kind: job.kind,
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
    pub(crate) fn submit(
        &mut self,
        unit: usize,
        micro: usize,
        kind: Kind,
        data: GradIn,
    ) -> Result<()> {
        let job = Job {
            unit,
            micro,
            kind,
            data,
        };
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

fn run(g: &Groups, kind: Kind, data: GradIn, unit: usize) -> Result<GradOut> {
    let n = g.shard.size();
    match (kind, data) {
        (Kind::Scatter, GradIn::Plain(v)) => {
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
        (Kind::Scatter, GradIn::Exact(x)) => {
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
        (Kind::Scatter, GradIn::Partial(p)) => {
            if g.replicas.is_some() {
                // rounded shards cannot be summed across replicas exactly
                return Err(Error::Config {
                    field: "reducer",
                    reason: "hybrid sharding reduces exact shard partials, not rounded shards"
                        .into(),
                });
            }
            let mut out = LowVec::zeros(g.opts.wire, p.len() / n);
            out.reduce_scatter_exact(&*g.shard, &p)
                .map_err(comm(format!("reduce_scatter of unit {unit}")))?;
            Ok(GradOut::Plain(out, true))
        }
        (Kind::AllReduce, GradIn::Partial(p)) => {
            let mut out = LowVec::zeros(g.opts.wire, p.len());
            out.all_reduce_exact(&*g.shard, &p)
                .map_err(comm(format!("all_reduce of unit {unit}")))?;
            Ok(GradOut::Plain(out, true))
        }
        (Kind::AllReduce, GradIn::Plain(mut v)) => {
            v.all_reduce(&*g.shard, &g.opts)
                .map_err(comm(format!("all_reduce of unit {unit}")))?;
            Ok(GradOut::Plain(v, false))
        }
        (Kind::AllReduce, GradIn::Exact(x)) => {
            // exact reduce-scatter, round this rank's chunk, all-gather the
            // rounded chunks: every rank gets the correctly rounded sum.
            let mine = exact::reduce_scatter(&*g.shard, &x, &format!("all_reduce of unit {unit}"))?;
            let total = x.len();
            drop(x);
            let out = LowVec::decode_exact(&mine, g.opts.wire)?;
            let mut full = out.zeros_like(total);
            out.all_gather(&*g.shard, &mut full)
                .map_err(comm(format!("all_gather in the all_reduce of unit {unit}")))?;
            Ok(GradOut::Plain(full, false))
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
