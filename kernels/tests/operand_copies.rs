//! What the mixed-precision products keep between calls is counted by
//! `operand_copy_bytes`: the rounded copies of the operands a thread has
//! multiplied (the largest of each side) and the packed blocks of the
//! threads that computed them, freed with their threads. Its own test binary: the count is process-wide, and no other
//! test may run products beside it.

use weft_kernels::{Bf16Path, Mode, Precision, bf16_path, matmul_forward, operand_copy_bytes};

/// Runs `f` on a fresh thread and returns what the count grew by while
/// the thread lived, and what it was after the thread ended.
fn on_a_thread(f: impl FnOnce() + Send) -> (usize, usize) {
    let before = operand_copy_bytes();
    let during = std::thread::scope(|s| {
        s.spawn(|| {
            f();
            operand_copy_bytes() - before
        })
        .join()
        .unwrap()
    });
    (during, operand_copy_bytes() - before)
}

#[test]
fn the_rounded_operand_copies_are_counted_and_freed_with_their_thread() {
    let (b, t, c, oc) = (2, 64, 96, 200);
    let x: Vec<f32> = (0..b * t * c).map(|i| (i % 7) as f32 * 0.25).collect();
    let w: Vec<f32> = (0..c * oc).map(|i| (i % 5) as f32 * 0.5).collect();
    let mode = Mode::Throughput;
    let product = |p: Precision| {
        let mut y = vec![0f32; b * t * oc];
        matmul_forward(&mut y, &x, &w, None, b, t, c, oc, mode, p).unwrap();
    };
    // f32: nothing kept
    assert_eq!(on_a_thread(|| product(Precision::F32)), (0, 0));
    // fp16: both operands rounded into f32 copies of their spans
    let (held, after) = on_a_thread(|| {
        product(Precision::F16);
        product(Precision::F16); // reused, not grown
    });
    assert_eq!(held, 4 * (x.len() + w.len()));
    assert_eq!(after, 0, "freed with the thread");
    // bf16: on AMX, 2-byte copies of both operands and the packed blocks
    // of whichever threads computed the product (kept by the pool's
    // threads for their next product); on AVX512-BF16 no copies (f32 is
    // rounded as it is packed), only the packed blocks — of the calling
    // thread here, the product being too small to split — freed with it;
    // the portable path keeps none
    let (held, after) = on_a_thread(|| product(Precision::Bf16));
    let copies = 2 * (x.len() + w.len());
    match bf16_path() {
        Bf16Path::Amx => {
            assert!(held >= copies, "{held}");
            assert!(after <= held - copies, "{after} of {held}");
        }
        Bf16Path::Avx512Bf16 => {
            assert!(held > 0);
            assert_eq!(after, 0, "freed with the thread");
        }
        Bf16Path::Portable => assert_eq!((held, after), (0, 0)),
    }
}
