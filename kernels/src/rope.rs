//! Rotary position embedding (RoPE, Su et al. 2021), in the "rotate
//! half" arrangement of Llama, Qwen, Mistral and GPT-NeoX: channel `j` of a
//! head's first `rotary_dim` channels pairs with channel `j + rotary_dim/2`,
//! the pair rotating by `position · inv_freq[j]`; channels past
//! `rotary_dim` pass through (partial rotary, as GPT-NeoX and Phi).
//!
//! [`Rope`] is the configuration (θ, rotary dims, Llama-3 frequency
//! scaling), [`RopeTable`] its cosines and sines for positions
//! `0..max_pos` (computed in f64, rounded once), and [`rope_forward`] /
//! [`rope_backward`] rotate heads in place.
//!
//! ```
//! use weft_kernels::{Rope, rope_backward, rope_forward};
//!
//! let rope = Rope::new(8, 8, 10_000.0);
//! let table = rope.table::<f32>(16)?;
//! // Two rows of one head of 8 channels, at positions 3 and 7.
//! let mut x: Vec<f32> = (0..16).map(|i| i as f32).collect();
//! let before = x.clone();
//! rope_forward(&mut x, &table, &[3, 7], 2, 8, 1)?;
//! rope_backward(&mut x, &table, &[3, 7], 2, 8, 1)?; // the inverse rotation
//! for (a, b) in x.iter().zip(&before) {
//!     assert!((a - b).abs() < 1e-4);
//! }
//! # Ok::<(), weft_kernels::Error>(())
//! ```

use rayon::prelude::*;

use crate::Real;
use crate::error::{Error, Result, check};

/// Llama-3's frequency scaling ("rope_type": "llama3" in a Hugging Face
/// `config.json`'s `rope_scaling`): wavelengths longer than
/// `original_max_position / low_freq_factor` are stretched by `factor`,
/// those shorter than `original_max_position / high_freq_factor` kept,
/// and those between interpolated smoothly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    /// How much the long wavelengths stretch (`factor`, 8 for Llama 3.1).
    pub factor: f64,
    /// `low_freq_factor` (1 for Llama 3.1).
    pub low_freq_factor: f64,
    /// `high_freq_factor` (4 for Llama 3.1).
    pub high_freq_factor: f64,
    /// The context the model was first trained on
    /// (`original_max_position_embeddings`, 8192 for Llama 3.1).
    pub original_max_position: usize,
}

/// A rotary embedding's configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Channels per head, HS.
    pub head_dim: usize,
    /// Channels of each head that rotate (even, at most `head_dim`); the
    /// rest pass through.
    pub rotary_dim: usize,
    /// The base θ of the frequencies `θ^(-2j/rotary_dim)` (`rope_theta`).
    pub theta: f64,
    /// Llama-3 frequency scaling, if any.
    pub scaling: Option<Llama3Scaling>,
}

impl Rope {
    /// Every channel rotating (`rotary_dim = head_dim`), no scaling.
    pub fn new(head_dim: usize, rotary_dim: usize, theta: f64) -> Self {
        Rope {
            head_dim,
            rotary_dim,
            theta,
            scaling: None,
        }
    }

    /// Checks the fields are consistent.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidArgument { op: "rope", reason });
        if self.rotary_dim == 0 || !self.rotary_dim.is_multiple_of(2) {
            return bad(format!(
                "rotary_dim = {} must be even and at least 2",
                self.rotary_dim
            ));
        }
        if self.rotary_dim > self.head_dim {
            return bad(format!(
                "rotary_dim = {} must not exceed head_dim = {}",
                self.rotary_dim, self.head_dim
            ));
        }
        if !(self.theta > 1.0 && self.theta.is_finite()) {
            return bad(format!("theta = {} must be finite and above 1", self.theta));
        }
        if let Some(s) = self.scaling {
            if !(s.factor >= 1.0 && s.factor.is_finite()) {
                return bad(format!("rope scaling factor = {} must be ≥ 1", s.factor));
            }
            if !(s.low_freq_factor > 0.0 && s.high_freq_factor > s.low_freq_factor) {
                return bad(format!(
                    "rope scaling needs 0 < low_freq_factor ({}) < high_freq_factor ({})",
                    s.low_freq_factor, s.high_freq_factor
                ));
            }
            if s.original_max_position == 0 {
                return bad("rope scaling original_max_position must be at least 1".into());
            }
        }
        Ok(())
    }

    /// The `rotary_dim / 2` inverse frequencies, after scaling
    /// (transformers' `_compute_default_rope_parameters` and
    /// `_compute_llama3_parameters`, in f64).
    pub fn inv_freq(&self) -> Vec<f64> {
        #[allow(clippy::cast_precision_loss)]
        let d = self.rotary_dim as f64;
        (0..self.rotary_dim / 2)
            .map(|j| {
                #[allow(clippy::cast_precision_loss)]
                let f = 1.0 / self.theta.powf((2 * j) as f64 / d);
                match self.scaling {
                    None => f,
                    Some(s) => {
                        #[allow(clippy::cast_precision_loss)]
                        let old = s.original_max_position as f64;
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < old / s.high_freq_factor {
                            f
                        } else if wavelen > old / s.low_freq_factor {
                            f / s.factor
                        } else {
                            let smooth = (old / wavelen - s.low_freq_factor)
                                / (s.high_freq_factor - s.low_freq_factor);
                            (1.0 - smooth) * f / s.factor + smooth * f
                        }
                    }
                }
            })
            .collect()
    }

    /// The cosines and sines for positions `0..max_pos`.
    ///
    /// # Errors
    /// As [`validate`](Self::validate).
    pub fn table<T: Real>(&self, max_pos: usize) -> Result<RopeTable<T>> {
        self.validate()?;
        let inv = self.inv_freq();
        let half = inv.len();
        let (mut cos, mut sin) = (Vec::with_capacity(max_pos * half), Vec::new());
        sin.reserve(max_pos * half);
        for p in 0..max_pos {
            for &f in &inv {
                #[allow(clippy::cast_precision_loss)]
                let a = p as f64 * f;
                cos.push(T::from_f64(a.cos()));
                sin.push(T::from_f64(a.sin()));
            }
        }
        Ok(RopeTable {
            cos,
            sin,
            half,
            head_dim: self.head_dim,
            max_pos,
        })
    }
}

/// [`Rope::table`]: `cos` and `sin` of `position · inv_freq[j]`,
/// `(max_pos, rotary_dim/2)` each.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable<T> {
    cos: Vec<T>,
    sin: Vec<T>,
    half: usize,
    head_dim: usize,
    max_pos: usize,
}

impl<T: Real> RopeTable<T> {
    /// Positions the table covers.
    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The table's memory in bytes.
    pub fn bytes(&self) -> usize {
        (self.cos.len() + self.sin.len()) * size_of::<T>()
    }

    fn check(&self, op: &'static str, x: &[T], positions: &[u32], shape: [usize; 3]) -> Result<()> {
        let [n, stride, heads] = shape;
        check(op, "x", x, n * stride)?;
        check(op, "positions", positions, n)?;
        if heads * self.head_dim > stride {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "{heads} heads of {} channels do not fit a row of {stride}",
                    self.head_dim
                ),
            });
        }
        if let Some(p) = positions.iter().find(|&&p| p as usize >= self.max_pos) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "position {p} is past the table's {} positions",
                    self.max_pos
                ),
            });
        }
        Ok(())
    }

    fn apply(&self, x: &mut [T], positions: &[u32], stride: usize, heads: usize, inverse: bool) {
        let (half, hd) = (self.half, self.head_dim);
        if half == 0 || stride == 0 {
            return;
        }
        x.par_chunks_mut(stride)
            .zip(positions.par_iter())
            .with_min_len(8)
            .for_each(|(row, &p)| {
                let p = p as usize;
                let c = &self.cos[p * half..(p + 1) * half];
                let s = &self.sin[p * half..(p + 1) * half];
                for head in row[..heads * hd].chunks_exact_mut(hd) {
                    rotate(&mut head[..2 * half], c, s, inverse);
                }
            });
    }
}

crate::simd::multiversion! {
    fn rotate<T: Real>(head: &mut [T], c: &[T], s: &[T], inverse: bool) {
        let (lo, hi) = head.split_at_mut(c.len());
        if inverse {
            for j in 0..c.len() {
                let (a, b) = (lo[j], hi[j]);
                lo[j] = a * c[j] + b * s[j];
                hi[j] = b * c[j] - a * s[j];
            }
        } else {
            // transformers: q·cos + rotate_half(q)·sin, rotate_half(q) = (-q2, q1).
            for j in 0..c.len() {
                let (a, b) = (lo[j], hi[j]);
                lo[j] = a * c[j] - b * s[j];
                hi[j] = b * c[j] + a * s[j];
            }
        }
    }
}

/// Rotates in place the first `heads` heads (of the table's `head_dim`
/// channels) of each of the `n` rows of `x (n, stride)`, row `r` by its
/// position `positions[r]`. Queries and keys of a fused `qkv` row lie
/// together at its start (the query heads, then the key heads), so one
/// call rotates both.
///
/// # Errors
/// [`Error::ShapeMismatch`] on a wrong buffer length,
/// [`Error::InvalidArgument`] if the heads do not fit a row or a position
/// is past the table.
pub fn rope_forward<T: Real>(
    x: &mut [T],
    table: &RopeTable<T>,
    positions: &[u32],
    n: usize,
    stride: usize,
    heads: usize,
) -> Result<()> {
    table.check("rope_forward", x, positions, [n, stride, heads])?;
    table.apply(x, positions, stride, heads, false);
    Ok(())
}

/// Backward of [`rope_forward`], in place on the gradient: the rotation
/// is orthogonal, so its input gradient is the output gradient rotated by
/// the negative angle.
///
/// # Errors
/// As [`rope_forward`].
pub fn rope_backward<T: Real>(
    dx: &mut [T],
    table: &RopeTable<T>,
    positions: &[u32],
    n: usize,
    stride: usize,
    heads: usize,
) -> Result<()> {
    table.check("rope_backward", dx, positions, [n, stride, heads])?;
    table.apply(dx, positions, stride, heads, true);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grads, rand_vec};

    /// The rotation written as the paper's complex multiplication:
    /// `(x_j + i·x_{j+h}) · e^{i·p·θ^{-2j/d}}`.
    #[test]
    fn forward_is_the_complex_rotation() {
        let rope = Rope::new(10, 8, 500.0);
        let table = rope.table::<f64>(32).unwrap();
        let (n, stride, heads) = (3, 25, 2);
        let x0 = rand_vec(n * stride, 3);
        let pos = [0u32, 5, 31];
        let mut x = x0.clone();
        rope_forward(&mut x, &table, &pos, n, stride, heads).unwrap();
        for (r, &p) in pos.iter().enumerate() {
            for h in 0..heads {
                for j in 0..10 {
                    let i = r * stride + h * 10 + j;
                    let want = if j < 4 {
                        let a = f64::from(p) * 500f64.powf(-(2.0 * j as f64) / 8.0);
                        let (re, im) = (x0[i], x0[i + 4]);
                        let (yr, yi) = (re * a.cos() - im * a.sin(), re * a.sin() + im * a.cos());
                        assert!((x[i + 4] - yi).abs() < 1e-14);
                        yr
                    } else if j < 8 {
                        continue;
                    } else {
                        x0[i] // partial rotary: passes through
                    };
                    assert!((x[i] - want).abs() < 1e-14, "row {r} head {h} channel {j}");
                }
            }
            // Channels past the heads are untouched.
            let tail = r * stride + heads * 10..(r + 1) * stride;
            assert_eq!(x[tail.clone()], x0[tail]);
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let rope = Rope::new(6, 6, 10_000.0);
        let table = rope.table::<f64>(9).unwrap();
        let (n, stride, heads) = (4, 13, 2);
        let pos = [1u32, 8, 0, 3];
        check_grads(
            &[rand_vec(n * stride, 11)],
            n * stride,
            |ins, out| {
                out.copy_from_slice(&ins[0]);
                rope_forward(out, &table, &pos, n, stride, heads).unwrap();
            },
            |_, dout, grads| {
                let mut g = dout.to_vec();
                rope_backward(&mut g, &table, &pos, n, stride, heads).unwrap();
                for (a, b) in grads[0].iter_mut().zip(&g) {
                    *a += b;
                }
            },
        );
    }

    /// transformers' `_compute_llama3_parameters` for Llama 3.1's settings
    /// (θ = 500000, head_dim 128, factor 8, low 1, high 4, 8192 positions):
    /// values printed by transformers 5.25, which computes in f32 (hence
    /// the tolerance). Frequency 30 lies in the smoothed middle band.
    #[test]
    fn llama3_scaling_matches_transformers() {
        let rope = Rope {
            scaling: Some(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            }),
            ..Rope::new(128, 128, 500_000.0)
        };
        let f = rope.inv_freq();
        assert_eq!(f.len(), 64);
        let transformers = [
            (0, 1.0),
            (10, 0.128_687_381_744_384_77),
            (20, 0.016_560_440_883_040_428),
            (30, 0.001_371_893_682_517_111_3),
            (40, 3.428_102_354_519_069e-5),
            (50, 4.411_534_519_022_098e-6),
            (63, 3.068_925_877_869_333e-7),
        ];
        for (j, want) in transformers {
            assert!(
                (f[j] - want).abs() <= 1e-6 * want,
                "frequency {j}: {} vs {want}",
                f[j]
            );
        }
    }

    #[test]
    fn bad_settings_and_positions_are_refused() {
        assert!(Rope::new(8, 7, 1e4).validate().is_err());
        assert!(Rope::new(8, 10, 1e4).validate().is_err());
        assert!(Rope::new(8, 8, 0.5).validate().is_err());
        let table = Rope::new(4, 4, 1e4).table::<f32>(4).unwrap();
        let mut x = vec![0.0f32; 8];
        let e = rope_forward(&mut x, &table, &[0, 4], 2, 4, 1).unwrap_err();
        assert!(e.to_string().contains("position 4"), "{e}");
        let e = rope_forward(&mut x, &table, &[0], 1, 8, 3).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
    }
}
