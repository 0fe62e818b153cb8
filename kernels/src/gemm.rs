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
