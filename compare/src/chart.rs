//! Charts, drawn one way for every plot weft makes: the browser page's
//! curves, `weft compare --plot` and `weft plan --plot`.
//!
//! [`Frame`] maps data to pixels (linear or logarithmic axes) and [`path`]
//! turns a series into SVG path data downsampled to the pixel grid: a
//! series with more points than pixel columns keeps, per column, its
//! first, minimum, maximum and last point, so spikes survive and a
//! 10k-step run draws as a few hundred segments. [`LineChart`] writes a
//! whole SVG document of line series with axes, ticks and a legend;
//! [`Bars`] one of stacked horizontal bars.
//!
//! ```
//! use weft_compare::chart::{LineChart, Series};
//!
//! let loss = Series::new("loss", vec![(1.0, 3.0), (2.0, 2.5), (3.0, 2.2)]);
//! let svg = LineChart::new("training loss", "step", "nats").svg(&[loss]);
//! assert!(svg.starts_with("<svg") && svg.contains("training loss"));
//! ```

use std::fmt::Write as _;

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
    /// Log-scale x (data ≤ 0 is skipped).
    pub log_x: bool,
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
            log_x: false,
        }
    }

    /// A frame of logarithmic axes fitting the positive finite points,
    /// each axis whole decades.
    #[must_use]
    pub fn fit_log_log(width: f64, height: f64, xs: &[f64], ys: &[f64]) -> Self {
        let decades = |v: &[f64]| {
            let logs: Vec<f64> = v
                .iter()
                .filter(|x| x.is_finite() && **x > 0.0)
                .map(|x| x.log10())
                .collect();
            let lo = logs.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = logs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            if lo.is_finite() {
                let (lo, hi) = (lo.floor(), hi.ceil());
                (10f64.powf(lo), 10f64.powf(hi.max(lo + 1.0)))
            } else {
                (1.0, 10.0)
            }
        };
        let both: Vec<(f64, f64)> = xs
            .iter()
            .zip(ys)
            .filter(|(x, y)| x.is_finite() && **x > 0.0 && y.is_finite() && **y > 0.0)
            .map(|(x, y)| (*x, *y))
            .collect();
        let (bx, by): (Vec<f64>, Vec<f64>) = both.into_iter().unzip();
        Self {
            width,
            height,
            x: decades(&bx),
            y: decades(&by),
            log_y: true,
            log_x: true,
        }
    }

    /// Pixel x of data `x` (on a log axis, data ≤ 0 is placed at the
    /// left edge; [`path`] skips it).
    #[must_use]
    pub fn px(&self, x: f64) -> f64 {
        if self.log_x {
            if x <= 0.0 {
                return 0.0;
            }
            (x.log10() - self.x.0.log10()) / (self.x.1.log10() - self.x.0.log10()) * self.width
        } else {
            (x - self.x.0) / (self.x.1 - self.x.0) * self.width
        }
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
        let py = frame.py(y).filter(|_| !frame.log_x || x > 0.0);
        let Some(py) = py else {
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

/// Round tick positions covering `[lo, hi]` (1, 2 or 5 times a power of
/// ten apart; at most 12).
#[must_use]
pub fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(f64::MIN_POSITIVE);
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + 1e-9 * span && out.len() < 12 {
        out.push(t);
        t += step;
    }
    out
}

/// The decades within `[lo, hi]` (a log axis' ticks).
fn decade_ticks(lo: f64, hi: f64) -> Vec<f64> {
    #[allow(clippy::cast_possible_truncation)]
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    (a..=b)
        .map(|d| 10f64.powi(d))
        .filter(|v| *v >= lo * 0.999 && *v <= hi * 1.001)
        .collect()
}

/// The colours of successive series (and bar categories).
pub const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
];

/// `s` with `&`, `<` and `>` escaped for SVG text.
#[must_use]
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// One line of a [`LineChart`].
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend.
    pub name: String,
    /// Points `(x, y)`, x increasing; non-finite y breaks the line.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed.
    pub dashed: bool,
    /// A dot at every point (for short series of measured points).
    pub markers: bool,
}

impl Series {
    /// A solid line through `points`.
    #[must_use]
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            points,
            dashed: false,
            markers: false,
        }
    }
}

/// A line chart as a whole SVG document: the series in their colours,
/// axes with round ticks (decades on a log axis), labels and a legend.
#[derive(Clone, Debug, PartialEq)]
pub struct LineChart {
    /// The title above the plot.
    pub title: String,
    /// The x axis' label.
    pub x_label: String,
    /// The y axis' label.
    pub y_label: String,
    /// Both axes logarithmic (data ≤ 0 left out).
    pub log_log: bool,
    /// Width and height of the document, px.
    pub size: (f64, f64),
}

/// Margins around the plot area: left, right, top, bottom.
const MARGIN: (f64, f64, f64, f64) = (80.0, 210.0, 40.0, 60.0);

impl LineChart {
    /// A linear chart of 760 × 440 px.
    #[must_use]
    pub fn new(title: &str, x_label: &str, y_label: &str) -> Self {
        Self {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            log_log: false,
            size: (760.0, 440.0),
        }
    }

    /// The same chart with logarithmic axes.
    #[must_use]
    pub fn log_log(mut self) -> Self {
        self.log_log = true;
        self
    }

    /// The document for `series`.
    #[must_use]
    pub fn svg(&self, series: &[Series]) -> String {
        let (w, h) = self.size;
        let (l, r, t, b) = MARGIN;
        let (pw, ph) = (w - l - r, h - t - b);
        // the axes fit the points that are drawn
        let (xs, ys): (Vec<f64>, Vec<f64>) = series
            .iter()
            .flat_map(|s| &s.points)
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .copied()
            .unzip();
        let frame = if self.log_log {
            Frame::fit_log_log(pw, ph, &xs, &ys)
        } else {
            Frame::fit(pw, ph, &xs, &ys, &[], false)
        };
        let mut svg = header(w, h, &self.title);
        let _ = writeln!(
            svg,
            r##"<g transform="translate({l} {t})"><path d="M0 0 V{ph} H{pw}" fill="none" stroke="#444"/>"##
        );
        let (xt, yt) = if self.log_log {
            (
                decade_ticks(frame.x.0, frame.x.1),
                decade_ticks(frame.y.0, frame.y.1),
            )
        } else {
            (ticks(frame.x.0, frame.x.1), ticks(frame.y.0, frame.y.1))
        };
        for v in xt {
            let x = frame.px(v);
            let _ = writeln!(
                svg,
                r##"<line x1="{x:.1}" y1="{ph}" x2="{x:.1}" y2="0" stroke="#eee"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="12">{}</text>"##,
                ph + 18.0,
                fmt_value(v)
            );
        }
        for v in yt {
            let Some(y) = frame.py(v) else { continue };
            let _ = writeln!(
                svg,
                r##"<line x1="0" y1="{y:.1}" x2="{pw}" y2="{y:.1}" stroke="#eee"/><text x="-6" y="{:.1}" text-anchor="end" font-size="12">{}</text>"##,
                y + 4.0,
                fmt_value(v)
            );
        }
        for (i, s) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let dash = if s.dashed {
                r#" stroke-dasharray="6,4""#
            } else {
                ""
            };
            let (xs, ys): (Vec<f64>, Vec<f64>) = s.points.iter().copied().unzip();
            let (d, _) = path(&frame, &xs, &ys);
            let _ = writeln!(
                svg,
                r#"<path d="{d}" fill="none" stroke="{color}" stroke-width="1.8"{dash}><title>{}</title></path>"#,
                escape(&s.name)
            );
            if s.markers {
                for &(x, y) in &s.points {
                    if let (Some(py), true) = (frame.py(y), !frame.log_x || x > 0.0) {
                        let _ = writeln!(
                            svg,
                            r#"<circle cx="{:.1}" cy="{py:.1}" r="3" fill="{color}"/>"#,
                            frame.px(x)
                        );
                    }
                }
            }
            let ly = 10.0 + 20.0 * i as f64;
            let _ = writeln!(
                svg,
                r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
                pw + 10.0,
                pw + 34.0,
                pw + 40.0,
                ly + 4.0,
                escape(&s.name)
            );
        }
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="13">{}</text><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="13" transform="rotate(-90 {:.1} {:.1})">{}</text></g>"#,
            pw / 2.0,
            ph + 40.0,
            escape(&self.x_label),
            -58.0,
            ph / 2.0,
            -58.0,
            ph / 2.0,
            escape(&self.y_label)
        );
        svg.push_str("</svg>\n");
        svg
    }
}

/// The SVG document's opening, a white background and the title.
fn header(w: f64, h: f64, title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{:.1}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        w / 2.0,
        escape(title)
    )
}

/// One bar of a [`Bars`] chart.
#[derive(Clone, Debug, PartialEq)]
pub struct Bar {
    /// Its label, left of the bar.
    pub label: String,
    /// Its parts, one per category, stacked left to right.
    pub parts: Vec<f64>,
    /// A dashed mark across the bar at this value (a capacity, a limit).
    pub mark: Option<f64>,
    /// Text right of the bar (its total, say).
    pub note: String,
}

/// Stacked horizontal bars as a whole SVG document: each bar's parts in
/// the categories' colours, a legend of the categories.
#[derive(Clone, Debug, PartialEq)]
pub struct Bars {
    /// The title above the bars.
    pub title: String,
    /// The categories, in stacking order.
    pub categories: Vec<String>,
}

impl Bars {
    /// The document for `bars`.
    #[must_use]
    pub fn svg(&self, bars: &[Bar]) -> String {
        let (label_w, bar, top, bottom) = (260.0, 22.0, 40.0, 60.0);
        let width = 880.0;
        #[allow(clippy::cast_precision_loss)]
        let height = top + bottom + bars.len().max(1) as f64 * (bar + 10.0);
        let max = bars
            .iter()
            .map(|b| b.parts.iter().sum::<f64>().max(b.mark.unwrap_or(0.0)))
            .fold(0.0, f64::max)
            .max(f64::MIN_POSITIVE);
        let scale = |v: f64| v / max * (width - label_w - 120.0);
        let mut svg = header(width, height, &self.title);
        for (i, n) in self.categories.iter().enumerate() {
            #[allow(clippy::cast_precision_loss)]
            let x = label_w + 110.0 * i as f64;
            let _ = writeln!(
                svg,
                r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
                height - 30.0,
                COLORS[i % COLORS.len()],
                x + 16.0,
                height - 19.0,
                escape(n)
            );
        }
        for (row, b) in bars.iter().enumerate() {
            #[allow(clippy::cast_precision_loss)]
            let y = top + row as f64 * (bar + 10.0);
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">{}</text>"#,
                label_w - 6.0,
                y + bar / 2.0 + 4.0,
                escape(&b.label)
            );
            let mut x = label_w;
            for (i, v) in b.parts.iter().enumerate() {
                let w = scale(*v);
                let _ = writeln!(
                    svg,
                    r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{bar}" fill="{}"/>"#,
                    COLORS[i % COLORS.len()]
                );
                x += w;
            }
            if let Some(m) = b.mark {
                let at = label_w + scale(m);
                let _ = writeln!(
                    svg,
                    r##"<line x1="{at:.1}" y1="{:.1}" x2="{at:.1}" y2="{:.1}" stroke="#000" stroke-dasharray="3,3"/>"##,
                    y - 3.0,
                    y + bar + 3.0
                );
            }
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" font-size="11">{}</text>"#,
                x + 4.0,
                y + bar / 2.0 + 4.0,
                escape(&b.note)
            );
        }
        svg.push_str("</svg>\n");
        svg
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
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0), [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(1.93, 2.31);
        assert!(
            t.len() >= 3 && t[0] >= 1.93 && *t.last().unwrap() <= 2.31,
            "{t:?}"
        );
        assert_eq!(decade_ticks(1.0, 1000.0), [1.0, 10.0, 100.0, 1000.0]);
    }

    #[test]
    fn charts_are_svg_with_every_series_and_escape_names() {
        let a = Series::new("a<b", vec![(1.0, 2.0), (10.0, 20.0)]);
        let b = Series {
            dashed: true,
            markers: true,
            ..Series::new("c", vec![(1.0, 3.0), (100.0, 0.5), (1000.0, f64::NAN)])
        };
        for chart in [
            LineChart::new("t", "x", "y"),
            LineChart::new("t", "x", "y").log_log(),
        ] {
            let s = chart.svg(&[a.clone(), b.clone()]);
            assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
            assert_eq!(s.matches("stroke-width=\"1.8\"").count(), 2, "{s}");
            // the NaN point is left out of the drawing and of the x axis
            assert!(
                s.contains("<title>c</title>") && !s.contains(">1000<"),
                "{s}"
            );
            assert!(s.contains("a&lt;b") && !s.contains("a<b"));
            assert_eq!(s.matches("<circle").count(), 2);
        }
        let bars = Bars {
            title: "memory".into(),
            categories: vec!["params".into(), "grads".into()],
        }
        .svg(&[Bar {
            label: "dp=2".into(),
            parts: vec![4.0, 2.0],
            mark: Some(8.0),
            note: "6 B".into(),
        }]);
        assert_eq!(bars.matches("<rect").count(), 1 + 2 + 2);
        assert!(bars.contains("stroke-dasharray"));
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
