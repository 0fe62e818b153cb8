//! Runtime SIMD dispatch.
//!
//! Release builds target the baseline x86-64 instruction set (no
//! `target-cpu=native` in committed config), so the hot loops are compiled
//! several times with wider instruction sets enabled and the best one the
//! running CPU supports is chosen at run time. The source of every version
//! is the same generic function; only the code generation differs, so the
//! results are identical bit for bit.

/// The instruction-set levels weft compiles its hot loops for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Baseline (SSE2 on x86-64, or whatever the target guarantees).
    Baseline,
    /// x86-64-v3: AVX2, FMA, BMI2.
    Avx2,
    /// x86-64-v4: AVX-512 F/BW/DQ/VL.
    Avx512,
}

/// The best level the running CPU supports.
///
/// The environment variable `WEFT_SIMD` (`baseline`, `avx2` or `avx512`)
/// caps it, for comparing code paths in benchmarks; it is read once.
pub fn level() -> Level {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let detected = detect();
        let cap = match std::env::var("WEFT_SIMD").ok().as_deref() {
            Some("baseline") => Level::Baseline,
            Some("avx2") => Level::Avx2,
            _ => Level::Avx512,
        };
        detected.min(cap)
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Level {
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("bmi2")
    {
        Level::Avx512
    } else if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("bmi2")
    {
        Level::Avx2
    } else {
        Level::Baseline
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Level {
    Level::Baseline
}

/// Defines a function whose body is compiled for each [`Level`] and
/// dispatched at run time. The body must be safe code; it is inlined into
/// `#[target_feature]` wrappers, which are called only when [`level`] says
/// the CPU supports their features. Every version comes from the same
/// source; the compiler does not contract `a*b+c` into an FMA for Rust
/// floats, so the versions agree bit for bit. Used by weft's other crates
/// (`weft_numerics::multiversion!`) for their hot loops.
///
/// ```
/// weft_numerics::multiversion! {
///     /// `d += s`, elementwise.
///     pub fn add(d: &mut [f32], s: &[f32]) {
///         for (a, b) in d.iter_mut().zip(s) {
///             *a += *b;
///         }
///     }
/// }
/// let mut d = [1.0f32, 2.0];
/// add(&mut d, &[0.5, 0.5]);
/// assert_eq!(d, [1.5, 2.5]);
/// ```
#[macro_export]
macro_rules! multiversion {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident $(<$($g:ident : $b:path),*>)? ($($a:ident : $t:ty),* $(,)?) $(-> $r:ty)? $body:block
    ) => {
        $(#[$meta])*
        $vis fn $name $(<$($g: $b),*>)? ($($a: $t),*) $(-> $r)? {
            #[inline(always)]
            fn inner $(<$($g: $b),*>)? ($($a: $t),*) $(-> $r)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi2")]
                fn v4 $(<$($g: $b),*>)? ($($a: $t),*) $(-> $r)? {
                    inner $(::<$($g),*>)? ($($a),*)
                }
                #[target_feature(enable = "avx2,fma,bmi2")]
                fn v3 $(<$($g: $b),*>)? ($($a: $t),*) $(-> $r)? {
                    inner $(::<$($g),*>)? ($($a),*)
                }
                match $crate::simd::level() {
                    // SAFETY: `level()` reported that the CPU supports every
                    // feature enabled on `v4`.
                    $crate::simd::Level::Avx512 => return unsafe { v4 $(::<$($g),*>)? ($($a),*) },
                    // SAFETY: as above, for `v3`'s features.
                    $crate::simd::Level::Avx2 => return unsafe { v3 $(::<$($g),*>)? ($($a),*) },
                    $crate::simd::Level::Baseline => {}
                }
            }
            inner $(::<$($g),*>)? ($($a),*)
        }
    };
}

pub(crate) use crate::multiversion;
