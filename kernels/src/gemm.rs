//! A bounds-checked wrapper over the `gemm` crate for strided row-major
//! views of slices.

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

/// `dst (m×n) = [dst +] scale · a (m×k) · b (k×n)`, where `dst` is
/// row-major with row stride `dst_rs`.
///
/// `threads`: `true` lets gemm split the work over the rayon pool (it
/// splits the m and n dimensions only, never k, so each element is summed
/// in the same order whatever the thread count).
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
    let par = if threads && m * n * k >= 64 * 64 * 64 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: all three views were checked to lie inside their slices, `dst`
    // is borrowed mutably so it aliases neither input, and `T` is f32 or f64,
    // both supported by `gemm`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
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
