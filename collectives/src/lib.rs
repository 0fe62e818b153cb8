//! How the ranks of a weft run talk to each other.
//!
//! This crate will own the `Communicator` trait that every parallel strategy
//! programs against (all-reduce, reduce-scatter, all-gather, broadcast,
//! all-to-all(v), send/recv, barrier, sub-groups), the ring, tree and
//! hierarchical algorithms behind it, an N-dimensional device mesh, per-link
//! traffic counters, timeouts and peer-loss errors instead of hangs, and three
//! backends: threads in one process (default), MPI and NCCL (cargo features).
//! Reductions accumulate in f32 or wider whatever the wire dtype, and a
//! reproducible mode builds on `weft_numerics::ExactSum`.
//!
//! Nothing is implemented yet: the crate exists so the workspace has its final
//! shape. See the collectives issue for the plan.
