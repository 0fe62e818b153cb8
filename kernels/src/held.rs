//! Buffers the kernels keep from call to call on a thread — the mixed
//! precision products' rounded and packed operand copies — counted, so
//! that what they hold can be reported ([`operand_copy_bytes`]).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes every thread's [`Held`] buffers hold together.
static HELD: AtomicUsize = AtomicUsize::new(0);

/// Bytes held now, over every thread of the process, by the buffers the
/// mixed-precision products keep for the next call: rounded copies of
/// their operands (bf16, or fp16 values in f32) on each calling thread
/// and the packed blocks of the bf16 paths on each thread that computes
/// (on AMX up to 1.5 MiB of the left operand and 512 KiB of the right
/// one, and a left operand of up to 16 MiB packed whole on the calling
/// thread; on AVX512-BF16 up to 512
/// columns and 128 rows by 1024 values of `k`, 1.25 MiB). The copies grow to the
/// largest operands a thread has multiplied (a language-model head's
/// logits gradient is the largest: `2·B·T·V` bytes in bf16, `4·B·T·V` for
/// fp16); all are freed when their thread ends; 0 when only f32 products
/// ran. The model's memory report ([`RankMemory`]) does not include them:
/// this is where a trainer reads them.
///
/// [`RankMemory`]: https://docs.rs/weft-model/latest/weft_model/struct.RankMemory.html
pub fn operand_copy_bytes() -> usize {
    HELD.load(Ordering::Relaxed)
}

/// A growable buffer whose capacity is counted in [`operand_copy_bytes`].
#[derive(Debug)]
pub(crate) struct Held<T>(Vec<T>);

impl<T> Held<T> {
    /// An empty buffer (nothing counted).
    pub(crate) const fn new() -> Self {
        Held(Vec::new())
    }

    fn bytes(&self) -> usize {
        self.0.capacity() * size_of::<T>()
    }
}

impl<T: Copy + Default> Held<T> {
    /// The first `n` elements, the buffer grown to hold them (never
    /// cleared or shrunk: every element is written before it is read).
    pub(crate) fn sized(&mut self, n: usize) -> &mut [T] {
        if self.0.len() < n {
            let before = self.bytes();
            self.0.resize(n, T::default());
            HELD.fetch_add(self.bytes() - before, Ordering::Relaxed);
        }
        &mut self.0[..n]
    }

    /// As [`sized`](Self::sized), from the buffer's first 64-byte
    /// boundary: the packed operands of the bf16 products, whose rows the
    /// instructions load a cache line at a time (tiles and vectors that
    /// straddle two lines load at half the rate or less: measured 2.2–2.5×
    /// on AMX's `tileloadd`).
    pub(crate) fn lines(&mut self, n: usize) -> &mut [T] {
        let pad = 64 / size_of::<T>().max(1);
        let s = self.sized(n + pad);
        let off = s.as_ptr().align_offset(64).min(pad);
        &mut s[off..off + n]
    }

    /// The first `n` elements (written by an earlier [`sized`](Self::sized)).
    pub(crate) fn get(&self, n: usize) -> &[T] {
        &self.0[..n]
    }
}

impl<T> Default for Held<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Drop for Held<T> {
    fn drop(&mut self) {
        HELD.fetch_sub(self.bytes(), Ordering::Relaxed);
    }
}
