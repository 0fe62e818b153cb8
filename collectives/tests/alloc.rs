//! Collectives allocate nothing in proportion to their buffers once warm:
//! every scratch buffer is pooled per rank (thread) or provided by the
//! caller, so a training step that calls the same collectives every step
//! does not map, fault in and free megabytes each time.
//!
//! A counting global allocator (hence a binary of its own) measures the
//! bytes and the number of allocations over repeated calls of each
//! collective on 2 and 4 thread ranks, at 256 KiB and 4 MiB of f32 (sizes
//! that `Auto` runs with the same algorithm); each must allocate less than
//! 1/256 of its buffer per call, all ranks together, and no more at 4 MiB
//! than twice what it does at 256 KiB:
//! per-call bookkeeping (a message's completion flags, the list of sends,
//! a few dozen small allocations) does not grow with the data.
#![allow(clippy::print_stdout, missing_docs)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use weft_collectives::repro::ExactPartial;
use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, LocalCluster, ReduceOp, ReduceOptions, bf16,
    shard_range,
};

struct Counting;

static BYTES: AtomicU64 = AtomicU64::new(0);
static COUNT: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        COUNT.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        COUNT.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        BYTES.fetch_add(new as u64, Ordering::Relaxed);
        COUNT.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { System.realloc(ptr, layout, new) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as the caller's contract.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[derive(Clone, Copy, Debug)]
enum Op {
    AllReduce(Algorithm, bool),
    ReduceScatter(Algorithm, bool),
    ReduceScatterBf16,
    AllGather(Algorithm),
    AllGatherInPlace(Algorithm),
    AllReduceExact,
    ReduceScatterExactDiv,
}

const CALLS: u64 = 8;

/// Bytes and allocations per call (all ranks together) of `op` on `n`
/// ranks with `elems` f32 elements.
fn per_call(op: Op, n: usize, elems: usize) -> (u64, u64) {
    let out = LocalCluster::builder(n).run_each(|comm| -> weft_collectives::Result<(u64, u64)> {
        let r = comm.rank();
        let grad: Vec<f32> = (0..elems)
            .map(|i| ((i * 31 + r * 7) as f32 * 1e-3).sin())
            .collect();
        let mut buf = grad.clone();
        let mut shard = vec![0f32; shard_range(elems, n, r).len()];
        let grad_bf16: Vec<bf16> = grad.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut shard_bf16 = vec![bf16::ZERO; shard.len()];
        let mut partial = ExactPartial::new(elems);
        partial.add(&grad)?;
        let mut call = || -> weft_collectives::Result<()> {
            match op {
                Op::AllReduce(a, repro) => {
                    buf.copy_from_slice(&grad);
                    comm.all_reduce_with(
                        &mut buf,
                        &ReduceOptions::new(ReduceOp::Sum)
                            .algorithm(a)
                            .reproducible(repro),
                    )
                }
                Op::ReduceScatter(a, repro) => comm.reduce_scatter_with(
                    &grad,
                    &mut shard,
                    &ReduceOptions::new(ReduceOp::Avg)
                        .algorithm(a)
                        .reproducible(repro),
                ),
                // bf16 on the wire, f32 accumulation (FSDP's bf16 gradients)
                Op::ReduceScatterBf16 => {
                    comm.reduce_scatter(&grad_bf16, &mut shard_bf16, ReduceOp::Sum)
                }
                Op::AllGather(a) => comm.all_gather_with(&grad[..shard.len()], &mut buf, a),
                Op::AllGatherInPlace(a) => comm.all_gather_in_place_with(&mut buf, a),
                Op::AllReduceExact => comm.all_reduce_exact(&partial, &mut buf, ReduceOp::Sum),
                Op::ReduceScatterExactDiv => comm.reduce_scatter_exact_div(&partial, &mut shard, 3),
            }
        };
        // warm: the pools fill on the first calls
        for _ in 0..3 {
            call()?;
        }
        comm.barrier()?;
        let (b0, c0) = (BYTES.load(Ordering::SeqCst), COUNT.load(Ordering::SeqCst));
        comm.barrier()?;
        for _ in 0..CALLS {
            call()?;
        }
        comm.barrier()?;
        let (b1, c1) = (BYTES.load(Ordering::SeqCst), COUNT.load(Ordering::SeqCst));
        comm.barrier()?;
        Ok((b1 - b0, c1 - c0))
    });
    // rank 0's window spans every rank's calls (between the barriers)
    let (bytes, count) = out
        .into_iter()
        .next()
        .expect("rank 0")
        .expect("rank panicked")
        .expect("collective failed");
    (bytes / CALLS, count / CALLS)
}

fn main() {
    let ops = [
        Op::AllReduce(Algorithm::Ring, false),
        Op::AllReduce(Algorithm::RecursiveDoubling, false),
        Op::AllReduce(Algorithm::Ring, true),
        Op::AllReduce(Algorithm::RecursiveDoubling, true),
        Op::ReduceScatter(Algorithm::Ring, false),
        Op::ReduceScatter(Algorithm::RecursiveDoubling, false),
        Op::ReduceScatter(Algorithm::Ring, true),
        Op::ReduceScatterBf16,
        Op::AllGather(Algorithm::Ring),
        Op::AllGather(Algorithm::RecursiveDoubling),
        Op::AllGatherInPlace(Algorithm::Ring),
        Op::AllReduceExact,
        Op::ReduceScatterExactDiv,
    ];
    // 256 KiB of f32: the bf16 reduce-scatter's 128 KiB are above
    // `SMALL_MESSAGE_BYTES` too, so that `Auto` picks the ring at both
    // sizes (recursive halving below keeps other bookkeeping)
    let small = 64 << 10;
    let large = 1 << 20; // 4 MiB of f32
    let mut failed = Vec::new();
    println!(
        "{:<48} {:>5} {:>14} {:>10} {:>14} {:>10}",
        "op", "ranks", "B/call 256KiB", "allocs", "B/call 4MiB", "allocs"
    );
    for n in [2, 4] {
        for op in ops {
            let (bs, cs) = per_call(op, n, small);
            let (bl, cl) = per_call(op, n, large);
            let name = format!("{op:?}");
            println!("{name:<48} {n:>5} {bs:>14} {cs:>10} {bl:>14} {cl:>10}");
            // 16× the data may not cost more than twice the bytes (plus
            // a little: the allocations of other ranks' waits and wake-ups
            // fall into rank 0's window at random)
            let limit = (large as u64 * 4) / 256;
            if bl >= limit || bl > 2 * bs + 1024 {
                failed.push(format!(
                    "{name} on {n} ranks: {bl} bytes per call at 4 MiB (limit {limit}; {bs} at 256 KiB)"
                ));
            }
        }
    }
    if !failed.is_empty() {
        for f in &failed {
            println!("FAIL {f}");
        }
        std::process::exit(1);
    }
    println!("no buffer-sized allocation per call");
}
