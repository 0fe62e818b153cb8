//! Runtime SIMD dispatch (the same idea as `weft_numerics::simd`).
//!
//! Release builds target baseline x86-64, so hot loops are compiled again
//! with AVX2 and AVX-512 enabled and the best version the CPU supports is
//! chosen at run time through [`weft_numerics::simd::level`]. Every version
//! comes from the same source; results differ only where the compiler may
//! contract `a*b+c` into an FMA, which it does not do for Rust floats, so
//! the versions agree bit for bit.

pub(crate) use weft_numerics::multiversion;
