//! A bounds-checked wrapper over the `gemm` crate for strided row-major
//! views of slices.

use rayon::prelude::*;

use crate::Real;

/// A strided read-only matrix view: element `(i, j)` is `data[i*rs + j*cs]`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> View<'a, T> {
    /// A row-major view with row stride `rs` (column stride 1).
    pub fn rows(data: &'a [T], rs: usize) -> Self {
        View { data, rs, cs: 1 }
    }
    /// The transpose of a row-major matrix with row stride `rs`.
    pub fn t(data: &'a [T], rs: usize) -> Self {
        View {
            data,
            rs: 1,
            cs: rs,
        }
    }
}

/// Widest column block passed to `gemm` in one call.
const N_BLOCK: usize = 4096;

fn last_index(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    (rows - 1) * rs + (cols - 1) * cs
}

/// Narrowest column block [`gemm()`] hands one thread: wide enough that a
/// block never drops to the GEMM library's small-output kernels (which
/// take over at `rows · cols <= 256`), so splitting changes no result.
const MIN_THREAD_COLS: usize = 256;

/// Columns per thread for an output `n` wide split over `threads`, or
/// `None` when there is one thread or a block would be narrower than
/// [`MIN_THREAD_COLS`]. Blocks start on multiples of 16 columns (one
/// AVX-512 vector).
pub(crate) fn column_split(n: usize, threads: usize) -> Option<usize> {
    if threads < 2 {
        return None;
    }
    let per = n.div_ceil(threads).next_multiple_of(16);
    let last = n.checked_sub(per * (n.div_ceil(per) - 1))?;
    (per >= MIN_THREAD_COLS && last >= MIN_THREAD_COLS && n > per).then_some(per)
}

/// The output's base pointer, shared by the pool's tasks (each writes its
/// own disjoint column block).
struct SendPtr<T>(*mut T);
// SAFETY: only used to hand disjoint column blocks of one exclusively
// borrowed output to pool tasks that end before the borrow does (see the
// call site).
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// `dst (m×n) = [dst +] scale · a (m×k) · b (k×n)`, where `dst` is
/// row-major with row stride `dst_rs`.
///
/// `threads`: `true` splits the output columns over the rayon pool, one
/// block per thread, each a single-threaded GEMM, or lets the library
/// split the rows of an output too narrow for that; never the k dimension,
/// so each element is summed in the same order whatever the thread count.
///
/// # Panics
/// If a view would read or write outside its slice (an internal bug: the
/// public kernels check shapes first).
#[allow(clippy::too_many_arguments, clippy::cast_possible_wrap)]
pub(crate) fn gemm<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    dst_rs: usize,
    accumulate: bool,
    a: View<'_, T>,
    b: View<'_, T>,
    scale: T,
    threads: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        last_index(m, n, dst_rs, 1) < dst.len(),
        "gemm: dst out of bounds"
    );
    if n > N_BLOCK && k > 0 {
        // `gemm` packs a kc × n panel of the right-hand side into a buffer it
        // allocates on every call; for n in the tens of thousands (the
        // vocabulary) that is a fresh 50–100 MB mapping per call, and the
        // kernel spends much of its time zeroing new pages. Column blocks
        // keep the buffer small enough for the allocator to reuse. Each
        // output element is still one dot product over all of k in the same
        // order, so results do not change.
        for j0 in (0..n).step_by(N_BLOCK) {
            let nb = N_BLOCK.min(n - j0);
            let bb = View {
                data: &b.data[j0 * b.cs..],
                rs: b.rs,
                cs: b.cs,
            };
            gemm(
                m,
                nb,
                k,
                &mut dst[j0..],
                dst_rs,
                accumulate,
                a,
                bb,
                scale,
                threads,
            );
        }
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                dst[i * dst_rs..i * dst_rs + n].fill(T::ZERO);
            }
        }
        return;
    }
    assert!(
        last_index(m, k, a.rs, a.cs) < a.data.len(),
        "gemm: lhs out of bounds"
    );
    assert!(
        last_index(k, n, b.rs, b.cs) < b.data.len(),
        "gemm: rhs out of bounds"
    );
    let big = threads && m * n * k >= 64 * 64 * 64;
    if big && let Some(per) = column_split(n, rayon::current_num_threads()) {
        // Each thread runs the whole reduction for its own columns,
        // packing its own operands: gemm's own threading packs the
        // right-hand side on the calling thread while the others wait,
        // which costs most when the operands come cold from memory (in a
        // training step, 2-3% of the step at GPT-2 small).
        let out = SendPtr(dst.as_mut_ptr());
        (0..n.div_ceil(per)).into_par_iter().for_each(|c| {
            let j0 = c * per;
            let out = &out;
            // SAFETY: the views were checked above to lie inside their
            // slices for all n columns, so columns `[j0, j0 + nb)` do too;
            // the blocks of the tasks are disjoint, so no element of `dst`
            // (borrowed mutably until every task is done) is written by
            // two of them.
            unsafe {
                raw_gemm(
                    m,
                    per.min(n - j0),
                    k,
                    out.0.add(j0),
                    dst_rs,
                    accumulate,
                    a,
                    b.data.as_ptr().add(j0 * b.cs),
                    b,
                    scale,
                    gemm::Parallelism::None,
                );
            }
        });
        return;
    }
    // Too narrow to split by columns: the library splits the rows.
    let par = if big {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: all three views were checked to lie inside their slices, `dst`
    // is borrowed mutably so it aliases neither input.
    unsafe {
        raw_gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_rs,
            accumulate,
            a,
            b.data.as_ptr(),
            b,
            scale,
            par,
        );
    }
}

/// The `gemm` crate's call for `dst (m×n, row stride dst_rs) = [dst +]
/// scale · a · b`, with `b`'s elements read from `b_ptr` with `b`'s strides.
///
/// # Safety
/// `dst`, `a` and `b_ptr` must be valid for every element of their `m×n`,
/// `m×k` and `k×n` shapes at those strides, `dst` must alias neither input
/// and no other thread may touch those `dst` elements during the call. `T`
/// is f32 or f64 (the `Real` types), both supported by `gemm`.
#[allow(clippy::too_many_arguments, clippy::cast_possible_wrap)]
unsafe fn raw_gemm<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    a: View<'_, T>,
    b_ptr: *const T,
    b: View<'_, T>,
    scale: T,
    par: gemm::Parallelism,
) {
    // SAFETY: the caller's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b_ptr,
            b.cs as isize,
            b.rs as isize,
            T::ONE,
            scale,
            false,
            false,
            false,
            par,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::rand_vec;

    #[test]
    fn column_split_keeps_blocks_wide() {
        assert_eq!(column_split(768, 1), None);
        assert_eq!(column_split(768, 2), Some(384));
        assert_eq!(column_split(2304, 2), Some(1152));
        assert_eq!(column_split(511, 2), None); // a 255-column block
        assert_eq!(column_split(520, 2), None); // 272 + 248 columns
        assert_eq!(column_split(1000, 3), Some(336)); // 336 + 336 + 328
    }

    /// Splitting the columns over threads gives every element the bits of
    /// the single-threaded GEMM (plain, transposed and strided views,
    /// accumulating or not), and the product itself (f64 reference).
    #[test]
    fn threaded_columns_give_single_thread_bits() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let (m, k, n) = (37usize, 300usize, 1000usize);
        let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        let a = f(rand_vec(m * k, 1));
        let at = f(rand_vec(k * m, 2));
        let b = f(rand_vec(k * n, 3));
        let bt = f(rand_vec(n * k, 4));
        let init = f(rand_vec(m * (n + 5), 5));
        for (ta, tb, acc) in [
            (false, false, false),
            (true, false, true),
            (false, true, true),
            (true, true, false),
        ] {
            let va = if ta {
                View::t(&at, m)
            } else {
                View::rows(&a, k)
            };
            let vb = if tb {
                View::t(&bt, k)
            } else {
                View::rows(&b, n)
            };
            let mut one = init.clone();
            gemm(m, n, k, &mut one, n + 5, acc, va, vb, 0.5f32, false);
            let mut many = init.clone();
            pool.install(|| gemm(m, n, k, &mut many, n + 5, acc, va, vb, 0.5f32, true));
            assert!(
                one.iter()
                    .zip(&many)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "bits differ (transposed a {ta}, b {tb}, accumulate {acc})"
            );
            for i in (0..m).step_by(7) {
                for j in (0..n).step_by(13) {
                    let mut want = if acc {
                        f64::from(init[i * (n + 5) + j])
                    } else {
                        0.0
                    };
                    for l in 0..k {
                        let x = f64::from(va.data[i * va.rs + l * va.cs]);
                        let y = f64::from(vb.data[l * vb.rs + j * vb.cs]);
                        want += 0.5 * x * y;
                    }
                    let got = f64::from(many[i * (n + 5) + j]);
                    assert!((got - want).abs() < 1e-4, "({i}, {j}): {got} vs {want}");
                }
            }
            // The padding between rows is untouched.
            assert!((0..m).all(|i| many[i * (n + 5) + n..(i + 1) * (n + 5)]
                == init[i * (n + 5) + n..(i + 1) * (n + 5)]));
        }
    }
}
