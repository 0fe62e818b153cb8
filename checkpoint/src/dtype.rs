//! Element types as they are stored on disk.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The element type of a stored tensor, spelled as safetensors spells it
/// (`"F32"`, `"BF16"`, ...). Floating types cover the training state;
/// integer types cover step counters, token positions and RNG words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Dtype {
    /// boolean, one byte.
    Bool,
    /// unsigned 8-bit.
    U8,
    /// signed 8-bit.
    I8,
    /// unsigned 16-bit.
    U16,
    /// signed 16-bit.
    I16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// unsigned 32-bit.
    U32,
    /// signed 32-bit.
    I32,
    /// IEEE single precision.
    F32,
    /// unsigned 64-bit.
    U64,
    /// signed 64-bit.
    I64,
    /// IEEE double precision.
    F64,
}

impl Dtype {
    /// Every dtype, in safetensors' order of increasing size.
    pub const ALL: [Dtype; 13] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::U16,
        Dtype::I16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::U32,
        Dtype::I32,
        Dtype::F32,
        Dtype::U64,
        Dtype::I64,
        Dtype::F64,
    ];

    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }

    /// The safetensors spelling (`"F32"`, `"BF16"`, `"BOOL"`, ...).
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::U16 => "U16",
            Dtype::I16 => "I16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::F32 => "F32",
            Dtype::U64 => "U64",
            Dtype::I64 => "I64",
            Dtype::F64 => "F64",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.safetensors_name())
    }
}

/// The error of parsing a [`Dtype`] name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown dtype `{0}` (expected one of BOOL, U8, I8, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64)"
)]
pub struct UnknownDtype(pub String);

impl FromStr for Dtype {
    type Err = UnknownDtype;

    /// Parses the safetensors spelling, case-insensitively, so that
    /// `weft_numerics::Dtype::name()` (`"f32"`, `"bf16"`) parses too.
    fn from_str(s: &str) -> Result<Self, UnknownDtype> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.safetensors_name().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownDtype(s.chars().take(64).collect()))
    }
}

impl Serialize for Dtype {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.safetensors_name())
    }
}

impl<'de> Deserialize<'de> for Dtype {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(d.safetensors_name().parse::<Dtype>().unwrap(), d);
            assert_eq!(
                d.safetensors_name()
                    .to_ascii_lowercase()
                    .parse::<Dtype>()
                    .unwrap(),
                d
            );
        }
        assert!("f8".parse::<Dtype>().is_err());
    }
}
