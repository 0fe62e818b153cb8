//! The machine's f32 arithmetic peak, measured rather than quoted: the
//! denominator of "percent of peak" (model FLOPs utilisation) figures.
//!
//! Each thread runs independent chains of fused multiply-adds on the
//! widest vectors the CPU has (16 chains, more than the FMA latency times
//! the number of FMA ports of current cores, so the ports never wait), and
//! the peak is the total FLOPs over the slowest thread's time. What it
//! reports is what the cores sustain right now, at the clock they hold
//! under a full vector load: on a machine shared with other jobs it is a
//! lower bound.

use std::time::Instant;

/// Independent accumulator chains per thread.
const CHAINS: usize = 16;

/// Measured f32 FMA throughput of `threads` threads running at once, in
/// GFLOP/s (one FMA counts as two FLOPs), best of `reps` runs of about
/// 0.1 s each. Uses AVX-512 or AVX2+FMA where the CPU has them, else
/// scalar arithmetic (then it is the peak of what the compiler emits, not
/// of the hardware).
///
/// ```no_run
/// let peak = weft_kernels::fma_peak_gflops(2, 3);
/// assert!(peak > 0.0);
/// ```
#[must_use]
pub fn fma_peak_gflops(threads: usize, reps: usize) -> f64 {
    let threads = threads.max(1);
    let iters = 20_000_000usize;
    let mut best = 0.0f64;
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        let flops: f64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads).map(|_| s.spawn(|| chains(iters))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum::<f64>()
        });
        let secs = start.elapsed().as_secs_f64();
        best = best.max(flops / secs / 1e9);
    }
    best
}

/// Runs `iters` rounds of [`CHAINS`] FMAs and returns the FLOPs done.
#[allow(clippy::cast_precision_loss)]
fn chains(iters: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU reported AVX-512F.
            std::hint::black_box(unsafe { x86::avx512(iters) });
            return (iters * CHAINS * 16 * 2) as f64;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU reported AVX2 and FMA.
            std::hint::black_box(unsafe { x86::avx2(iters) });
            return (iters * CHAINS * 8 * 2) as f64;
        }
    }
    let mut acc = [0.0f32; CHAINS];
    let (a, b) = (
        std::hint::black_box(1.000_000_1f32),
        std::hint::black_box(0.999_999f32),
    );
    for _ in 0..iters {
        for x in &mut acc {
            *x = *x * a + b;
        }
    }
    std::hint::black_box(acc);
    (iters * CHAINS * 2) as f64
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m256, __m512, _mm256_add_ps, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_storeu_ps,
        _mm512_add_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps, _mm512_set1_ps,
    };

    use super::CHAINS;

    /// `iters` rounds of [`CHAINS`] independent 16-lane FMAs; returns their
    /// sum (the caller passes it through `black_box`, so the work cannot be
    /// optimised away).
    #[target_feature(enable = "avx512f")]
    pub(super) fn avx512(iters: usize) -> f64 {
        let a = _mm512_set1_ps(std::hint::black_box(1.000_000_1));
        let b = _mm512_set1_ps(std::hint::black_box(0.999_999));
        let mut acc: [__m512; CHAINS] = [_mm512_set1_ps(0.0); CHAINS];
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm512_fmadd_ps(a, *x, b);
            }
        }
        let mut s = _mm512_set1_ps(0.0);
        for x in acc {
            s = _mm512_add_ps(s, x);
        }
        f64::from(_mm512_reduce_add_ps(s))
    }

    /// As [`avx512`] with 8-lane AVX2 vectors.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn avx2(iters: usize) -> f64 {
        let a = _mm256_set1_ps(std::hint::black_box(1.000_000_1));
        let b = _mm256_set1_ps(std::hint::black_box(0.999_999));
        let mut acc: [__m256; CHAINS] = [_mm256_set1_ps(0.0); CHAINS];
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm256_fmadd_ps(a, *x, b);
            }
        }
        let mut s = _mm256_set1_ps(0.0);
        for x in acc {
            s = _mm256_add_ps(s, x);
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds the 8 floats the store writes.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
        lanes.iter().map(|&x| f64::from(x)).sum()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn peak_is_positive_and_finite() {
        let p = super::fma_peak_gflops(1, 1);
        assert!(p.is_finite() && p > 0.0, "{p}");
    }
}
