//! What the MPI benches share: the three collectives they time and the
//! bus-bandwidth factor that turns a call's time into nccl-tests' busbw.

/// A collective a bench times.
#[derive(Clone, Copy, PartialEq)]
pub enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Op {
    /// Its name in the tables.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
        }
    }

    /// nccl-tests' busbw factor over `n` ranks: algbw × 2(n−1)/n for
    /// all-reduce, × (n−1)/n for the other two.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            _ => (n - 1.0) / n,
        }
    }
}
