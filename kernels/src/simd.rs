//! Runtime SIMD dispatch (the same idea as `weft_numerics::simd`).
//!
//! Release builds target baseline x86-64, so hot loops are compiled again
//! with AVX2 and AVX-512 enabled and the best version the CPU supports is
//! chosen at run time through [`weft_numerics::simd::level`]. Every version
//! comes from the same source; results differ only where the compiler may
//! contract `a*b+c` into an FMA, which it does not do for Rust floats, so
//! the versions agree bit for bit.

/// Defines a function whose body is compiled for AVX-512, AVX2 and
/// baseline, dispatched at run time. The body must be safe code.
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
                match weft_numerics::simd::level() {
                    // SAFETY: `level()` reported that the CPU supports every
                    // feature enabled on `v4`.
                    weft_numerics::simd::Level::Avx512 => return unsafe { v4 $(::<$($g),*>)? ($($a),*) },
                    // SAFETY: as above, for `v3`'s features.
                    weft_numerics::simd::Level::Avx2 => return unsafe { v3 $(::<$($g),*>)? ($($a),*) },
                    weft_numerics::simd::Level::Baseline => {}
                }
            }
            inner $(::<$($g),*>)? ($($a),*)
        }
    };
}

pub(crate) use multiversion;
