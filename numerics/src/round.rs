//! Correct rounding to nearest-even into any IEEE binary format.

/// An IEEE 754 binary interchange format, by its field widths.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Format {
    /// Stored significand bits (p − 1).
    pub mant_bits: u32,
    /// Exponent bits.
    pub exp_bits: u32,
}

pub(crate) const F64: Format = Format {
    mant_bits: 52,
    exp_bits: 11,
};
pub(crate) const F32: Format = Format {
    mant_bits: 23,
    exp_bits: 8,
};
pub(crate) const F16: Format = Format {
    mant_bits: 10,
    exp_bits: 5,
};
pub(crate) const BF16: Format = Format {
    mant_bits: 7,
    exp_bits: 8,
};

impl Format {
    pub fn bias(self) -> i32 {
        (1 << (self.exp_bits - 1)) - 1
    }
    pub fn sign_bit(self) -> u64 {
        1 << (self.mant_bits + self.exp_bits)
    }
    pub fn inf(self) -> u64 {
        ((1 << self.exp_bits) - 1) << self.mant_bits
    }
    pub fn nan(self) -> u64 {
        self.inf() | (1 << (self.mant_bits - 1))
    }
    /// Exponent of one ulp of the smallest subnormal: `emin − (p − 1)`.
    pub fn min_q(self) -> i32 {
        1 - self.bias() - self.mant_bits as i32
    }
    /// The exponent `q` of the last kept bit for a value whose leading bit
    /// has weight `2^top_exp`.
    pub fn ulp_exp(self, top_exp: i32) -> i32 {
        (top_exp - self.mant_bits as i32).max(self.min_q())
    }

    /// Packs `kept · 2^q` (plus one ulp if `round_up`), where `kept` holds at
    /// most `p` bits and `q` comes from [`ulp_exp`](Self::ulp_exp), into
    /// this format's bits; overflow gives infinity.
    pub fn pack(self, negative: bool, mut kept: u64, mut q: i32, round_up: bool) -> u64 {
        let sign = if negative { self.sign_bit() } else { 0 };
        if round_up {
            kept += 1;
            if kept == 1 << (self.mant_bits + 1) {
                kept >>= 1;
                q += 1;
            }
        }
        let biased = if kept >> self.mant_bits != 0 {
            q + self.mant_bits as i32 + self.bias()
        } else {
            0 // subnormal or zero: q is the minimum exponent
        };
        if biased >= (1 << self.exp_bits) - 1 {
            return sign | self.inf();
        }
        sign | ((biased as u64) << self.mant_bits) | (kept & ((1 << self.mant_bits) - 1))
    }

    /// `x` rounded to nearest-even into this format, as bits.
    pub fn round_f64(self, x: f64) -> u64 {
        let negative = x.is_sign_negative();
        if x.is_nan() {
            return self.nan();
        }
        if x.is_infinite() {
            return self.inf() | if negative { self.sign_bit() } else { 0 };
        }
        let b = x.to_bits();
        let e = ((b >> 52) & 0x7ff) as i32;
        let frac = b & 0x000f_ffff_ffff_ffff;
        let m = if e == 0 { frac } else { frac | (1 << 52) };
        if m == 0 {
            return if negative { self.sign_bit() } else { 0 };
        }
        let q0 = e.max(1) - 1075; // x = m · 2^q0
        let top_exp = q0 + 63 - m.leading_zeros() as i32;
        let q = self.ulp_exp(top_exp);
        let shift = q - q0;
        if shift <= 0 {
            return self.pack(negative, m << -shift, q, false);
        }
        let shift = shift as u32;
        let (kept, guard, sticky) = if shift > 64 {
            (0, false, true)
        } else if shift == 64 {
            (0, m >> 63 == 1, m << 1 != 0)
        } else {
            let rest = m & ((1 << shift) - 1);
            let half = 1u64 << (shift - 1);
            (m >> shift, rest & half != 0, rest & (half - 1) != 0)
        };
        self.pack(negative, kept, q, guard && (sticky || kept & 1 == 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hardware's f64 → f32 conversion is an independent oracle for the
    /// f32 format; identity for f64.
    #[test]
    fn matches_hardware_conversion() {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for i in 0..200_000u32 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Every exponent region, including f32 subnormals and overflow.
            let exp = (s % 320) as i32 - 170;
            let x = f64::from_bits((s >> 12) | 0x3ff0_0000_0000_0000) * 2f64.powi(exp);
            let x = if i % 2 == 0 { x } else { -x };
            assert_eq!(F32.round_f64(x) as u32, (x as f32).to_bits(), "{x:e}");
            assert_eq!(F64.round_f64(x), x.to_bits());
        }
        for x in [
            0.0,
            -0.0,
            f64::INFINITY,
            f64::MIN_POSITIVE,
            5e-324,
            f64::MAX,
        ] {
            assert_eq!(F32.round_f64(x) as u32, (x as f32).to_bits(), "{x:e}");
        }
        assert!(f32::from_bits(F32.round_f64(f64::NAN) as u32).is_nan());
    }
}
