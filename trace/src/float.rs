//! Serde helpers for `f64` fields that may hold NaN or an infinity.
//!
//! JSON has no literal for NaN or infinities (serde_json writes them as
//! `null` and cannot read `null` back into an `f64`). A diverging loss is
//! exactly what a metrics log must be able to record, so these fields write
//! finite values as JSON numbers and non-finite ones as the strings `"NaN"`,
//! `"Infinity"` and `"-Infinity"`. Reading accepts those strings, numbers,
//! and `null` (read as NaN).

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserializer, Serializer};

/// Serialize an `f64`, writing non-finite values as strings.
///
/// # Errors
/// Whatever the serializer returns.
pub fn serialize<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
    if value.is_finite() {
        serializer.serialize_f64(*value)
    } else if value.is_nan() {
        serializer.serialize_str("NaN")
    } else if *value > 0.0 {
        serializer.serialize_str("Infinity")
    } else {
        serializer.serialize_str("-Infinity")
    }
}

/// Deserialize an `f64` written by [`serialize`] (or a plain number, or
/// `null` read as NaN).
///
/// # Errors
/// When the value is neither a number, `null`, nor one of the strings
/// `"NaN"`, `"Infinity"`, `"-Infinity"` (also `"inf"`, `"+inf"`, `"-inf"`).
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    deserializer.deserialize_any(FloatVisitor)
}

struct FloatVisitor;

impl<'de> Visitor<'de> for FloatVisitor {
    type Value = f64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(r#"a number, null, or one of "NaN", "Infinity", "-Infinity""#)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
        Ok(v)
    }

    #[allow(clippy::cast_precision_loss)]
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
        Ok(v as f64)
    }

    #[allow(clippy::cast_precision_loss)]
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
        Ok(v as f64)
    }

    fn visit_unit<E: de::Error>(self) -> Result<f64, E> {
        Ok(f64::NAN)
    }

    fn visit_none<E: de::Error>(self) -> Result<f64, E> {
        Ok(f64::NAN)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<f64, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
        match v {
            "NaN" | "nan" => Ok(f64::NAN),
            "Infinity" | "inf" | "+inf" | "+Infinity" => Ok(f64::INFINITY),
            "-Infinity" | "-inf" => Ok(f64::NEG_INFINITY),
            other => Err(E::invalid_value(de::Unexpected::Str(other), &self)),
        }
    }
}

/// `Option<f64>` through this module: `None` written as `null` (or left
/// out, with `skip_serializing_if = "Option::is_none"`), and read from
/// `null` or an absent key (with `default`).
pub mod option {
    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    struct Float(#[serde(with = "crate::float")] f64);

    /// Serialize an `Option<f64>`, non-finite values as strings.
    ///
    /// # Errors
    /// Whatever the serializer returns.
    // serde's `with` hands `&Option<f64>` by reference.
    #[allow(clippy::ref_option)]
    pub fn serialize<S: Serializer>(value: &Option<f64>, serializer: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(v) => crate::float::serialize(v, serializer),
            None => serializer.serialize_none(),
        }
    }

    /// Deserialize an `Option<f64>` written by [`serialize`].
    ///
    /// # Errors
    /// As [`crate::float::deserialize`].
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<f64>, D::Error> {
        Ok(Option::<Float>::deserialize(deserializer)?.map(|f| f.0))
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize, Debug)]
    struct X {
        #[serde(with = "crate::float")]
        v: f64,
    }

    fn round(v: f64) -> (String, f64) {
        let s = serde_json::to_string(&X { v }).unwrap();
        let back: X = serde_json::from_str(&s).unwrap();
        (s, back.v)
    }

    #[test]
    fn finite_values_are_numbers() {
        assert_eq!(round(1.5), (r#"{"v":1.5}"#.to_string(), 1.5));
        assert_eq!(round(-0.25).1.to_bits(), (-0.25f64).to_bits());
    }

    #[test]
    fn non_finite_values_round_trip() {
        let (s, v) = round(f64::NAN);
        assert_eq!(s, r#"{"v":"NaN"}"#);
        assert!(v.is_nan());
        assert_eq!(round(f64::INFINITY).1, f64::INFINITY);
        assert_eq!(round(f64::NEG_INFINITY).1, f64::NEG_INFINITY);
        assert_eq!(round(f64::NEG_INFINITY).0, r#"{"v":"-Infinity"}"#);
    }

    #[test]
    fn null_and_integers_are_accepted_and_junk_is_not() {
        let x: X = serde_json::from_str(r#"{"v":null}"#).unwrap();
        assert!(x.v.is_nan());
        let x: X = serde_json::from_str(r#"{"v":3}"#).unwrap();
        assert_eq!(x.v, 3.0);
        let err = serde_json::from_str::<X>(r#"{"v":"lots"}"#).unwrap_err();
        assert!(err.to_string().contains("lots"), "{err}");
    }
}
