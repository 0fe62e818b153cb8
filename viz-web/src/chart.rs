//! Line charts over steps as SVG path data, downsampled to the pixel grid.
//!
//! A series with more points than pixel columns keeps, per column, its
//! first, minimum, maximum and last point, so spikes survive the
//! downsampling and a 10k-step run draws as a few hundred segments.

/// A chart's pixel box and data ranges.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Frame {
    /// Width in px.
    pub width: f64,
    /// Height in px.
    pub height: f64,
    /// Data x range.
    pub x: (f64, f64),
    /// Data y range.
    pub y: (f64, f64),
    /// Log-scale y (data ≤ 0 is skipped).
    pub log_y: bool,
}

impl Frame {
    /// A frame fitting the finite points of `xs`/`ys` (and `extra` y values
    /// such as a floor line), padded by 5% in y.
    #[must_use]
    pub fn fit(
        width: f64,
        height: f64,
        xs: &[f64],
        ys: &[f64],
        extra: &[f64],
        log_y: bool,
    ) -> Self {
        let (mut x0, mut x1) = (f64::INFINITY, f64::NEG_INFINITY);
        let (mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY);
        for (&x, &y) in xs.iter().zip(ys) {
            if x.is_finite() {
                x0 = x0.min(x);
                x1 = x1.max(x);
            }
            if y.is_finite() && (!log_y || y > 0.0) {
                y0 = y0.min(y);
                y1 = y1.max(y);
            }
        }
        for &y in extra {
            if y.is_finite() && (!log_y || y > 0.0) {
                y0 = y0.min(y);
                y1 = y1.max(y);
            }
        }
        if !x0.is_finite() {
            (x0, x1) = (0.0, 1.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        if !y0.is_finite() {
            (y0, y1) = if log_y { (0.1, 1.0) } else { (0.0, 1.0) };
        }
        if log_y {
            let (a, b) = (y0.log10(), y1.log10());
            let pad = ((b - a) * 0.05).max(0.05);
            (y0, y1) = (10f64.powf(a - pad), 10f64.powf(b + pad));
        } else {
            let pad = ((y1 - y0) * 0.05).max(y1.abs() * 0.05).max(1e-12);
            (y0, y1) = (y0 - pad, y1 + pad);
        }
        Self {
            width,
            height,
            x: (x0, x1),
            y: (y0, y1),
            log_y,
        }
    }

    /// Pixel x of data `x`.
    #[must_use]
    pub fn px(&self, x: f64) -> f64 {
        (x - self.x.0) / (self.x.1 - self.x.0) * self.width
    }

    /// Pixel y of data `y` (`None` when it cannot be drawn).
    #[must_use]
    pub fn py(&self, y: f64) -> Option<f64> {
        if !y.is_finite() || (self.log_y && y <= 0.0) {
            return None;
        }
        let u = if self.log_y {
            (y.log10() - self.y.0.log10()) / (self.y.1.log10() - self.y.0.log10())
        } else {
            (y - self.y.0) / (self.y.1 - self.y.0)
        };
        Some(self.height * (1.0 - u))
    }
}

/// SVG path data (`M x y L x y ...`) for the series; non-finite values
/// break the line. Returns the path and the number of points drawn.
#[must_use]
pub fn path(frame: &Frame, xs: &[f64], ys: &[f64]) -> (String, usize) {
    let mut out = String::new();
    let mut drawn = 0;
    let mut pen_down = false;
    let mut col: Option<i64> = None;
    let mut bucket: Vec<(f64, f64)> = Vec::new();
    let flush =
        |bucket: &mut Vec<(f64, f64)>, out: &mut String, pen_down: &mut bool, drawn: &mut usize| {
            if bucket.is_empty() {
                return;
            }
            let first = bucket[0];
            let last = bucket[bucket.len() - 1];
            let lo = bucket
                .iter()
                .copied()
                .fold(first, |a, b| if b.1 > a.1 { b } else { a });
            let hi = bucket
                .iter()
                .copied()
                .fold(first, |a, b| if b.1 < a.1 { b } else { a });
            let mut pts = vec![first, lo, hi, last];
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            pts.dedup();
            for (x, y) in pts {
                out.push_str(if *pen_down { "L" } else { "M" });
                out.push_str(&format!("{x:.1} {y:.1} "));
                *pen_down = true;
                *drawn += 1;
            }
            bucket.clear();
        };
    for (&x, &y) in xs.iter().zip(ys) {
        let Some(py) = frame.py(y) else {
            flush(&mut bucket, &mut out, &mut pen_down, &mut drawn);
            pen_down = false;
            continue;
        };
        let px = frame.px(x);
        #[allow(clippy::cast_possible_truncation)]
        let c = px.floor() as i64;
        if col != Some(c) {
            flush(&mut bucket, &mut out, &mut pen_down, &mut drawn);
            col = Some(c);
        }
        bucket.push((px, py));
    }
    flush(&mut bucket, &mut out, &mut pen_down, &mut drawn);
    (out.trim_end().to_owned(), drawn)
}

/// Short text for an axis value.
#[must_use]
pub fn fmt_value(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 {
        "0".into()
    } else if v.fract() == 0.0 && a < 1e5 {
        format!("{v:.0}")
    } else if !(1e-3..1e5).contains(&a) {
        format!("{v:.1e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_series_keeps_every_point_and_breaks_on_nan() {
        let xs = [1.0, 2.0, 3.0, 4.0];
        let ys = [1.0, f64::NAN, 3.0, 2.0];
        let f = Frame::fit(300.0, 100.0, &xs, &ys, &[], false);
        assert_eq!(f.x, (1.0, 4.0));
        let (p, n) = path(&f, &xs, &ys);
        assert_eq!(n, 3);
        assert_eq!(p.matches('M').count(), 2, "{p}");
        assert!(p.starts_with("M0.0 "), "{p}");
    }

    #[test]
    fn long_series_is_bounded_by_columns_and_keeps_spikes() {
        let xs: Vec<f64> = (0..10_000).map(f64::from).collect();
        let mut ys: Vec<f64> = xs.iter().map(|x| 3.0 - x / 10_000.0).collect();
        ys[5000] = 50.0;
        let f = Frame::fit(500.0, 100.0, &xs, &ys, &[], false);
        let (p, n) = path(&f, &xs, &ys);
        assert!(n <= 4 * 501, "{n}");
        let top = f.py(50.0).unwrap();
        assert!(p.contains(&format!(" {top:.1}")), "the spike survives");
    }

    #[test]
    fn log_scale_skips_non_positive() {
        let xs = [1.0, 2.0, 3.0];
        let ys = [1e-4, 0.0, 1e-3];
        let f = Frame::fit(100.0, 100.0, &xs, &ys, &[], true);
        assert!(f.y.0 < 1e-4 && f.y.1 > 1e-3);
        assert_eq!(f.py(0.0), None);
        assert_eq!(path(&f, &xs, &ys).1, 2);
        assert_eq!(fmt_value(0.0003), "3.0e-4");
        assert_eq!(fmt_value(2.5), "2.50");
        assert_eq!(fmt_value(50.0), "50");
    }
}
