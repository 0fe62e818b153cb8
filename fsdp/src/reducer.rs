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
use weft_collectives::{Communicator, CommunicatorExt, ReduceOp, ReduceOptions};

use crate::error::{Error, Result, comm};
use crate::lowp::LowVec;

/// Gradients handed to the worker.
#[derive(Debug)]
pub(crate) enum GradIn {
    /// Rounded values (the reduce dtype) of the whole padded unit.
    Plain(LowVec),
    /// One micro-batch's f32 gradient of the whole padded unit
    /// (reproducible mode, when a rank's step has several micro-batches or
    /// the shards have replicas): chunk `r` goes to rank `r` as values,
    /// which adds every rank's chunk exactly into the accumulator of its
    /// shard that the worker keeps for the unit — f32's bytes on the wire,
    /// not an exact encoding of about twice as many. `first` starts the
    /// accumulator afresh; `last` carries the divisor: the accumulator is
    /// then summed exactly across the replicas (hybrid), divided and
    /// rounded once.
    Values {
        g: Vec<f32>,
        first: bool,
        last: Option<u64>,
    },
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
    /// Added to the unit's exact accumulator, which the worker keeps until
    /// the last micro-batch: the bytes it holds now.
    Accumulated(usize),
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
                // each unit's exact accumulator of its shard (`GradIn::Values`)
                let mut accs: Vec<Option<ExactPartial>> = Vec::new();
                while let Ok(job) = jobs.recv() {
                    let start = Instant::now();
                    let result = run(&groups, &mut accs, job.data, job.unit);
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

fn run(
    g: &Groups,
    accs: &mut Vec<Option<ExactPartial>>,
    data: GradIn,
    unit: usize,
) -> Result<GradOut> {
    let n = g.shard.size();
    let what = || format!("reduce_scatter of unit {unit}");
    match data {
        GradIn::Plain(v) => {
            let len = v.len() / n;
            let mut out = v.zeros_like(len);
            v.reduce_scatter(&*g.shard, &mut out, &g.opts)
                .map_err(comm(what()))?;
            if let Some(rep) = &g.replicas {
                out.all_reduce(&**rep, &g.opts)
                    .map_err(comm(format!("all_reduce across replicas of unit {unit}")))?;
            }
            Ok(GradOut::Plain(out, false))
        }
        GradIn::Values {
            g: grad,
            first,
            last,
        } => {
            let chunk = grad.len() / n;
            if accs.len() <= unit {
                accs.resize_with(unit + 1, || None);
            }
            let slot = &mut accs[unit];
            if first || slot.as_ref().is_some_and(|a| a.len() != chunk) {
                *slot = None;
            }
            let acc = slot.get_or_insert_with(|| ExactPartial::new(chunk));
            g.shard
                .reduce_scatter_add_exact(&grad, acc)
                .map_err(comm(what()))?;
            drop(grad);
            let Some(divisor) = last else {
                return Ok(GradOut::Accumulated(acc.encoded_bytes()));
            };
            let acc = slot.take().unwrap_or_else(|| ExactPartial::new(chunk));
            let mut out = LowVec::zeros(g.opts.wire, chunk);
            match &g.replicas {
                Some(rep) => out
                    .all_reduce_exact_div(&**rep, &acc, divisor)
                    .map_err(comm(format!("all_reduce across replicas of unit {unit}")))?,
                None => out
                    .div_to(&acc, divisor)
                    .map_err(comm(format!("dividing the exact gradient of unit {unit}")))?,
            }
            Ok(GradOut::Plain(out, true))
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
                .map_err(comm(what()))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use weft_collectives::{Algorithm, Dtype, LocalCluster};

    /// Rank `rank`'s gradient of micro-batch `m`: values spread over many
    /// binades, so that any rounded intermediate sum would show.
    fn grad(rank: usize, m: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let x = (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add((rank * 31 + m * 7) as u32 * 97);
                ((x % 20_001) as f32 - 10_000.0) * 2f32.powi((x % 40) as i32 - 30)
            })
            .collect()
    }

    /// Every rank's shard of the exact sum of all contributions divided by
    /// `by`, rounded once, as one rank computes it.
    fn want(ranks: usize, micro: &[usize], len: usize, by: u64) -> Vec<Vec<f32>> {
        let chunk = len / ranks;
        (0..ranks)
            .map(|r| {
                let mut p = ExactPartial::new(chunk);
                for q in 0..ranks {
                    for &m in micro {
                        p.add(&grad(q, m, len)[r * chunk..(r + 1) * chunk]).unwrap();
                    }
                }
                let mut out = vec![0.0f32; chunk];
                p.div_to(&mut out, by).unwrap();
                out
            })
            .collect()
    }

    #[test]
    fn values_accumulate_exactly_and_the_first_micro_batch_starts_afresh() {
        let (ranks, len) = (3, 3 * 200);
        let got = LocalCluster::run(ranks, |comm| -> Result<Vec<f32>> {
            let rank = comm.rank();
            let shard: Arc<dyn Communicator> = Arc::new(comm);
            let mut r = Reducer::start(Groups {
                shard,
                replicas: None,
                opts: options(Algorithm::Ring, Dtype::F32),
            })?;
            let values = |m: usize, first: bool, last: Option<u64>| GradIn::Values {
                g: grad(rank, m, len),
                first,
                last,
            };
            // a micro-batch of a step abandoned before its last
            r.submit(0, 0, values(9, true, None))?;
            for m in 0..3 {
                r.submit(0, m, values(m, m == 0, (m == 2).then_some(7)))?;
            }
            let mut last = None;
            for i in 0..4 {
                match r.next()?.result? {
                    GradOut::Accumulated(bytes) => assert!(i < 3 && bytes >= 4 * len / ranks),
                    GradOut::Plain(LowVec::F32(v), true) if i == 3 => last = Some(v),
                    other => panic!("unexpected result {i}: {other:?}"),
                }
            }
            Ok(last.unwrap())
        })
        .unwrap();
        let want = want(ranks, &[0, 1, 2], len, 7);
        for (r, g) in got.into_iter().enumerate() {
            let g = g.unwrap();
            assert!(
                g.iter()
                    .zip(&want[r])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {r}"
            );
        }
    }

    #[test]
    fn replicas_sum_their_exact_shards_before_rounding() {
        // 2 replicas × 2 shards, 2 micro-batches each: the shard group is
        // ranks {2i, 2i+1}, the replica group {j, j+2}
        let len = 2 * 150;
        let got = LocalCluster::run(4, |comm| -> Result<Vec<f32>> {
            let rank = comm.rank();
            let key = rank as u32;
            let shard: Arc<dyn Communicator> = Arc::from(comm.split(key / 2, key).unwrap());
            let replicas: Arc<dyn Communicator> = Arc::from(comm.split(key % 2, key).unwrap());
            let mut r = Reducer::start(Groups {
                shard,
                replicas: Some(replicas),
                opts: options(Algorithm::Ring, Dtype::F32),
            })?;
            for m in 0..2 {
                let g = grad(rank, m, len);
                r.submit(
                    0,
                    m,
                    GradIn::Values {
                        g,
                        first: m == 0,
                        last: (m == 1).then_some(8),
                    },
                )?;
            }
            assert!(matches!(r.next()?.result?, GradOut::Accumulated(_)));
            match r.next()?.result? {
                GradOut::Plain(LowVec::F32(v), true) => Ok(v),
                other => panic!("unexpected result: {other:?}"),
            }
        })
        .unwrap();
        // shard s holds the exact sum over all four ranks' chunk s
        let chunk = len / 2;
        for (rank, g) in got.into_iter().enumerate() {
            let s = rank % 2;
            let mut p = ExactPartial::new(chunk);
            for q in 0..4 {
                for m in 0..2 {
                    p.add(&grad(q, m, len)[s * chunk..(s + 1) * chunk]).unwrap();
                }
            }
            let mut want = vec![0.0f32; chunk];
            p.div_to(&mut want, 8).unwrap();
            let g = g.unwrap();
            assert!(
                g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {rank}"
            );
        }
    }
}
