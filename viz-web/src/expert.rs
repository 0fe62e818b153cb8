//! Expert load: the steps × experts matrix of one MoE layer (or all layers
//! summed), its balance curves, and the heatmap image.
//!
//! The heatmap is an uncompressed BMP built here and shown as an `<img>`
//! data URL: one pixel per (step bin, expert), so 10k steps × 64 experts is
//! one image element rather than 640k DOM nodes, and the colours are
//! computed (and tested) in plain Rust.

use std::collections::BTreeMap;

use weft_trace::ExpertLoadRecord;

use weft_compare::LoadError;

/// Steps wider than this are averaged into bins for the image.
pub const MAX_COLUMNS: usize = 2048;

/// Every `expert_load.jsonl` record as dense matrices.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertLoad {
    /// File it came from.
    pub file: String,
    /// Distinct steps, ascending.
    pub steps: Vec<u64>,
    /// Distinct layers, ascending.
    pub layers: Vec<u32>,
    /// Experts per layer `E`.
    pub experts: usize,
    /// `load[(l * S + s) * E + e]`: tokens kept by expert `e` of layer
    /// `layers[l]` at step `steps[s]` (0 where no record).
    pub load: Vec<u64>,
    /// `dropped[l * S + s]`.
    pub dropped: Vec<u64>,
    /// Records read.
    pub records: usize,
}

/// Which layer a view shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerSel {
    /// Sum of all layers (curves: mean of the per-layer values).
    All,
    /// One layer, by index into [`ExpertLoad::layers`].
    One(usize),
}

/// Per-step balance figures of a [`LayerSel`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Curves {
    /// Busiest expert over the mean load (1 is perfect balance); NaN for a
    /// step with no tokens.
    pub max_over_mean: Vec<f64>,
    /// MaxVio = max/mean − 1 (the auxiliary-loss-free balancing paper's
    /// measure).
    pub max_vio: Vec<f64>,
    /// Dropped assignments.
    pub dropped: Vec<u64>,
}

impl ExpertLoad {
    /// Gather records into matrices.
    ///
    /// # Errors
    /// [`LoadError::Invalid`] when there are no records, or when a layer's
    /// expert count differs from the first record's (naming the record).
    pub fn new(file: &str, records: &[ExpertLoadRecord]) -> Result<Self, LoadError> {
        let first = records.first().ok_or_else(|| LoadError::Invalid {
            file: file.to_owned(),
            message: "no records (expected lines like {\"step\":1,\"layer\":0,\"tokens_per_expert\":[...],\"dropped\":0})".into(),
        })?;
        let experts = first.num_experts();
        if experts == 0 {
            return Err(LoadError::Invalid {
                file: file.to_owned(),
                message: "record 1 has an empty tokens_per_expert".into(),
            });
        }
        let mut steps: Vec<u64> = records.iter().map(|r| r.step).collect();
        steps.sort_unstable();
        steps.dedup();
        let mut layers: Vec<u32> = records.iter().map(|r| r.layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let step_ix: BTreeMap<u64, usize> =
            steps.iter().enumerate().map(|(i, s)| (*s, i)).collect();
        let layer_ix: BTreeMap<u32, usize> =
            layers.iter().enumerate().map(|(i, l)| (*l, i)).collect();
        let ns = steps.len();
        let mut load = vec![0u64; layers.len() * ns * experts];
        let mut dropped = vec![0u64; layers.len() * ns];
        for (i, r) in records.iter().enumerate() {
            if r.num_experts() != experts {
                return Err(LoadError::Invalid {
                    file: file.to_owned(),
                    message: format!(
                        "record {} (step {}, layer {}) has {} experts; the first record has {experts}",
                        i + 1,
                        r.step,
                        r.layer,
                        r.num_experts()
                    ),
                });
            }
            let (l, s) = (layer_ix[&r.layer], step_ix[&r.step]);
            let row = (l * ns + s) * experts;
            load[row..row + experts].copy_from_slice(&r.tokens_per_expert);
            dropped[l * ns + s] = r.dropped;
        }
        Ok(Self {
            file: file.to_owned(),
            steps,
            layers,
            experts,
            load,
            dropped,
            records: records.len(),
        })
    }

    fn row(&self, layer: usize, step: usize) -> &[u64] {
        let i = (layer * self.steps.len() + step) * self.experts;
        &self.load[i..i + self.experts]
    }

    /// Tokens per expert at step index `step` for `sel`.
    #[must_use]
    pub fn at(&self, sel: LayerSel, step: usize) -> Vec<u64> {
        match sel {
            LayerSel::One(l) => self.row(l, step).to_vec(),
            LayerSel::All => {
                let mut out = vec![0u64; self.experts];
                for l in 0..self.layers.len() {
                    for (o, x) in out.iter_mut().zip(self.row(l, step)) {
                        *o += x;
                    }
                }
                out
            }
        }
    }

    /// Balance curves over steps for `sel`.
    #[must_use]
    pub fn curves(&self, sel: LayerSel) -> Curves {
        let layers: Vec<usize> = match sel {
            LayerSel::All => (0..self.layers.len()).collect(),
            LayerSel::One(l) => vec![l],
        };
        let ns = self.steps.len();
        let mut c = Curves::default();
        for s in 0..ns {
            let (mut sum, mut n, mut drop) = (0.0, 0usize, 0u64);
            for &l in &layers {
                if let Some(r) = max_over_mean(self.row(l, s)) {
                    sum += r;
                    n += 1;
                }
                drop += self.dropped[l * ns + s];
            }
            #[allow(clippy::cast_precision_loss)]
            let m = if n == 0 { f64::NAN } else { sum / n as f64 };
            c.max_over_mean.push(m);
            c.max_vio.push(m - 1.0);
            c.dropped.push(drop);
        }
        c
    }

    /// The heatmap for `sel`: experts top to bottom, steps left to right,
    /// at most [`MAX_COLUMNS`] columns (each the mean over its steps).
    #[must_use]
    pub fn heatmap(&self, sel: LayerSel) -> Heatmap {
        let ns = self.steps.len();
        let cols = ns.min(MAX_COLUMNS);
        let e = self.experts;
        let mut rel = vec![0.0f64; cols * e];
        let mut n_in = vec![0usize; cols];
        for s in 0..ns {
            let c = s * cols / ns;
            let row = self.at(sel, s);
            let total: u64 = row.iter().sum();
            n_in[c] += 1;
            if total == 0 {
                continue;
            }
            #[allow(clippy::cast_precision_loss)]
            let mean = total as f64 / e as f64;
            for (x, v) in row.iter().enumerate() {
                #[allow(clippy::cast_precision_loss)]
                let r = *v as f64 / mean;
                rel[x * cols + c] += r;
            }
        }
        for x in 0..e {
            for c in 0..cols {
                if n_in[c] > 0 {
                    #[allow(clippy::cast_precision_loss)]
                    let n = n_in[c] as f64;
                    rel[x * cols + c] /= n;
                }
            }
        }
        Heatmap { cols, rows: e, rel }
    }

    /// Index of the step at or just before `step` (for a cursor).
    #[must_use]
    pub fn step_index(&self, step: u64) -> usize {
        self.steps.partition_point(|s| *s <= step).saturating_sub(1)
    }
}

fn max_over_mean(row: &[u64]) -> Option<f64> {
    let total: u64 = row.iter().sum();
    let max = *row.iter().max()?;
    if total == 0 {
        return None;
    }
    #[allow(clippy::cast_precision_loss)]
    Some(max as f64 * row.len() as f64 / total as f64)
}

/// Load relative to the step's mean (1 = balanced), `rows` × `cols`.
#[derive(Debug, Clone, PartialEq)]
pub struct Heatmap {
    /// Columns (step bins).
    pub cols: usize,
    /// Rows (experts).
    pub rows: usize,
    /// `rel[row * cols + col]`.
    pub rel: Vec<f64>,
}

/// Colour of a relative load: blue under the mean, white at it, red over
/// it, saturating at a factor of 4 either way (log scale).
#[must_use]
pub fn colour(rel: f64) -> [u8; 3] {
    let t = if rel <= 0.0 {
        -1.0
    } else {
        (rel.log2() / 2.0).clamp(-1.0, 1.0)
    };
    let lerp = |a: f64, b: f64, u: f64| {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let v = (a + (b - a) * u).round().clamp(0.0, 255.0) as u8;
        v
    };
    let white = [247.0, 247.0, 247.0];
    let (end, u) = if t < 0.0 {
        ([33.0, 102.0, 172.0], -t)
    } else {
        ([178.0, 24.0, 43.0], t)
    };
    [
        lerp(white[0], end[0], u),
        lerp(white[1], end[1], u),
        lerp(white[2], end[2], u),
    ]
}

impl Heatmap {
    /// The image as a 24-bit BMP file.
    #[must_use]
    pub fn to_bmp(&self) -> Vec<u8> {
        let w = self.cols;
        let h = self.rows;
        let stride = (3 * w).div_ceil(4) * 4;
        let size = 54 + stride * h;
        let mut b = Vec::with_capacity(size);
        let u32le = |b: &mut Vec<u8>, v: usize| {
            b.extend_from_slice(&u32::try_from(v).unwrap_or(u32::MAX).to_le_bytes());
        };
        b.extend_from_slice(b"BM");
        u32le(&mut b, size);
        u32le(&mut b, 0);
        u32le(&mut b, 54);
        u32le(&mut b, 40);
        u32le(&mut b, w);
        u32le(&mut b, h);
        b.extend_from_slice(&1u16.to_le_bytes());
        b.extend_from_slice(&24u16.to_le_bytes());
        for v in [0usize, stride * h, 2835, 2835, 0, 0] {
            u32le(&mut b, v);
        }
        // Bottom-up rows: the last expert first, so expert 0 is on top.
        for row in (0..h).rev() {
            let start = b.len();
            for c in 0..w {
                let [r, g, bl] = colour(self.rel[row * w + c]);
                b.extend_from_slice(&[bl, g, r]);
            }
            b.resize(start + stride, 0);
        }
        b
    }

    /// The image as a `data:image/bmp;base64,...` URL.
    #[must_use]
    pub fn data_url(&self) -> String {
        format!("data:image/bmp;base64,{}", base64(&self.to_bmp()))
    }
}

/// Standard base64 with padding.
#[must_use]
pub fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for ch in data.chunks(3) {
        let n = (u32::from(ch[0]) << 16)
            | (u32::from(*ch.get(1).unwrap_or(&0)) << 8)
            | u32::from(*ch.get(2).unwrap_or(&0));
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= ch.len() {
                out.push(char::from(A[(n >> shift) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(step: u64, layer: u32, load: &[u64], dropped: u64) -> ExpertLoadRecord {
        ExpertLoadRecord {
            step,
            layer,
            tokens_per_expert: load.to_vec(),
            dropped,
            router_entropy: None,
        }
    }

    #[test]
    fn matrices_curves_and_sum_over_layers() {
        let r = [
            rec(1, 0, &[4, 4, 4, 4], 0),
            rec(1, 1, &[16, 0, 0, 0], 3),
            rec(2, 0, &[8, 0, 8, 0], 1),
        ];
        let x = ExpertLoad::new("e.jsonl", &r).unwrap();
        assert_eq!((x.steps.len(), x.layers.len(), x.experts), (2, 2, 4));
        assert_eq!(x.at(LayerSel::All, 0), vec![20, 4, 4, 4]);
        assert_eq!(
            x.at(LayerSel::One(1), 1),
            vec![0, 0, 0, 0],
            "missing record reads as 0"
        );
        let c = x.curves(LayerSel::One(1));
        assert_eq!(c.max_over_mean[0], 4.0);
        assert_eq!(c.max_vio[0], 3.0);
        assert!(c.max_over_mean[1].is_nan());
        let c = x.curves(LayerSel::All);
        assert_eq!(c.max_over_mean[0], 2.5, "mean of 1 and 4");
        assert_eq!(c.dropped, vec![3, 1]);
        assert_eq!(x.step_index(1), 0);
        assert_eq!(x.step_index(7), 1);
    }

    #[test]
    fn mismatched_expert_counts_are_named() {
        let err =
            ExpertLoad::new("e.jsonl", &[rec(1, 0, &[1, 2], 0), rec(1, 1, &[1], 0)]).unwrap_err();
        assert!(
            err.to_string()
                .contains("record 2 (step 1, layer 1) has 1 experts"),
            "{err}"
        );
        assert!(ExpertLoad::new("e.jsonl", &[]).is_err());
    }

    #[test]
    fn heatmap_bins_and_bmp_layout() {
        let recs: Vec<_> = (1..=5000).map(|s| rec(s, 0, &[s, 0, 1, 1], 0)).collect();
        let x = ExpertLoad::new("e.jsonl", &recs).unwrap();
        let h = x.heatmap(LayerSel::One(0));
        assert_eq!((h.cols, h.rows), (MAX_COLUMNS, 4));
        assert!(h.rel[0] > 1.0 && h.rel[h.cols] == 0.0);
        let bmp = h.to_bmp();
        assert_eq!(&bmp[..2], b"BM");
        assert_eq!(u32::from_le_bytes(bmp[18..22].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(bmp[22..26].try_into().unwrap()), 4);
        assert_eq!(bmp.len(), 54 + 2048 * 3 * 4);
        // Top row (expert 0) is the last row in the file; expert 1 (0 tokens) is deep blue.
        let row1 = 54 + 2 * 2048 * 3;
        assert_eq!(&bmp[row1..row1 + 3], &[172, 102, 33]);
    }

    #[test]
    fn colours_and_base64() {
        assert_eq!(colour(1.0), [247, 247, 247]);
        assert_eq!(colour(4.0), [178, 24, 43]);
        assert_eq!(colour(100.0), [178, 24, 43]);
        assert_eq!(colour(0.0), [33, 102, 172]);
        assert_eq!(base64(b"Man"), "TWFu");
        assert_eq!(base64(b"Ma"), "TWE=");
        assert_eq!(base64(b"M"), "TQ==");
        assert_eq!(base64(b""), "");
    }
}
