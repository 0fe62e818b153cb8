//! What the metrics charts compute before they draw, as TensorBoard's
//! scalar charts do: smoothing ([`smooth`]), the y-range that ignores
//! outliers ([`inlier_range`]), the part of the run shown ([`range_start`]),
//! ticks of a log axis ([`log_ticks`]), the tokens a step trains
//! ([`tokens_per_step`]) and numbers at a precision meant for reading
//! ([`short_number`], [`fmt_count`]).

/// The lowest and highest quantiles [`inlier_range`] keeps, as
/// TensorBoard's "ignore outliers in chart scaling".
pub const INLIER_QUANTILES: (f64, f64) = (0.05, 0.95);

/// `ys` smoothed by an exponential moving average of weight `weight`
/// (0: none, towards 1: smoother), debiased as TensorBoard's smoothing is:
/// the average of the first values is not pulled towards 0. Non-finite
/// values are kept where they are and left out of the average.
#[must_use]
pub fn smooth(ys: &[f64], weight: f64) -> Vec<f64> {
    let w = weight.clamp(0.0, 0.999);
    let mut last = 0.0;
    let mut n = 0;
    ys.iter()
        .map(|&y| {
            if !y.is_finite() {
                return y;
            }
            last = last * w + (1.0 - w) * y;
            n += 1;
            last / (1.0 - w.powi(n))
        })
        .collect()
}

/// The `q` quantile of sorted `v` (linear between neighbours).
fn quantile(v: &[f64], q: f64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let at = q * (v.len() - 1) as f64;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let (i, j) = (at.floor() as usize, at.ceil() as usize);
    v[i] + (v[j] - v[i]) * (at - at.floor())
}

/// The range of the finite values of `ys` between the quantiles
/// [`INLIER_QUANTILES`] (positive values only with `log`): a chart fitted to
/// it shows where most of the values lie, and the few far above (the loss
/// of the first steps) or below run off its edge. `None` without values.
#[must_use]
pub fn inlier_range(ys: &[f64], log: bool) -> Option<(f64, f64)> {
    let mut v: Vec<f64> = ys
        .iter()
        .copied()
        .filter(|y| y.is_finite() && (!log || *y > 0.0))
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some((
        quantile(&v, INLIER_QUANTILES.0),
        quantile(&v, INLIER_QUANTILES.1),
    ))
}

/// The first step shown when only the last `percent` of the steps
/// `first..=last` is (100 or more: `first`).
#[must_use]
pub fn range_start(first: f64, last: f64, percent: u32) -> f64 {
    if percent >= 100 || last <= first {
        return first;
    }
    last - (last - first) * f64::from(percent) / 100.0
}

/// The decimals `v` needs (at most 6) to print as itself.
fn decimals(v: f64) -> usize {
    (0..6)
        .find(|d| {
            let p = 10f64.powi(*d);
            ((v * p).round() / p - v).abs() <= 1e-9 * v.abs().max(1e-12)
        })
        .map_or(6, |d| usize::try_from(d).unwrap_or(6))
}

/// Labels of axis ticks: on a linear axis (`shared`) with the decimals of
/// the finest tick on every tick (`1.6`, `1.8`, `2.0`), on a log axis each
/// with its own (`0.001`, `1`, `1000`); 0 as `0`, very large or small
/// values in exponent form.
#[must_use]
pub fn tick_labels(ticks: &[f64], shared: bool) -> Vec<String> {
    let top = ticks.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let common = ticks.iter().map(|v| decimals(*v)).max().unwrap_or(0);
    ticks
        .iter()
        .map(|&v| {
            if v == 0.0 {
                "0".to_owned()
            } else if !(1e-3..1e5).contains(&top) {
                format!("{v:.1e}")
            } else {
                let d = if shared { common } else { decimals(v) };
                format!("{v:.d$}")
            }
        })
        .collect()
}

/// Ticks of a log axis over `[lo, hi]` (`0 < lo < hi`): 1, 2 and 5 times
/// the powers of ten, thinned to the powers alone over many decades, and
/// every digit where the range is less than a decade (so a loss from 1.6
/// to 5.6 gets 2, 3, 4 and 5); over a narrower range, where that gives
/// fewer than 3, a linear axis' ticks (1.6, 1.8, 2.0).
#[must_use]
pub fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    if !(lo > 0.0 && hi > lo && hi.is_finite()) {
        return Vec::new();
    }
    #[allow(clippy::cast_possible_truncation)]
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    // m / 10^k rather than m · 10^-k: 0.3, not 0.30000000000000004
    let at = |m: f64, d: i32| {
        if d < 0 {
            m / 10f64.powi(-d)
        } else {
            m * 10f64.powi(d)
        }
    };
    let within = |mantissas: &[f64]| -> Vec<f64> {
        (a..=b)
            .flat_map(|d| mantissas.iter().map(move |m| at(*m, d)))
            .filter(|v| *v >= lo * 0.999 && *v <= hi * 1.001)
            .collect()
    };
    for m in [
        &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0][..],
        &[1.0, 2.0, 5.0],
        &[1.0],
    ] {
        let t = within(m);
        if t.len() < 3 {
            return crate::timeline::ticks(lo, hi, 4);
        }
        if t.len() <= 6 {
            return t;
        }
    }
    within(&[1.0])
}

/// Tokens trained per step: the global batch (`train.batch_size`
/// sequences, whatever the layout) times the sequence length
/// (`model.block_size`), read from `config.toml`'s text as the trainer
/// writes it (`[table]` headers, `key = value` lines; no TOML parser in
/// the page for two integers). `None` where the file does not give both.
#[must_use]
pub fn tokens_per_step(config: &str) -> Option<u64> {
    let (mut table, mut batch, mut block) = ("", None, None);
    for line in config.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if let Some(t) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            table = t.trim();
        } else if let Some((k, v)) = line.split_once('=') {
            let v = v
                .trim()
                .replace('_', "")
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0);
            match (table, k.trim()) {
                ("train", "batch_size") => batch = v,
                ("model", "block_size") => block = v,
                _ => {}
            }
        }
    }
    Some(batch? * block?)
}

/// A count in short SI form: `950`, `12.3k`, `4.10M`, `1.25G`.
#[must_use]
pub fn fmt_count(v: f64) -> String {
    let a = v.abs();
    let (x, unit) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e3 {
        (v / 1e3, "k")
    } else {
        return format!("{v:.0}");
    };
    let digits = if x.abs() >= 100.0 {
        0
    } else if x.abs() >= 10.0 {
        1
    } else {
        2
    };
    format!("{x:.digits$}{unit}")
}

/// A value of an event's details as text for reading: a number with a
/// fraction shortened to 4 significant digits (`1.7366`, `0.0001234`,
/// `2.5e-7`), everything else (integers, words) as it is.
#[must_use]
pub fn short_number(text: &str) -> String {
    let is_float = text.contains(['.', 'e', 'E']);
    let Ok(v) = text.parse::<f64>() else {
        return text.to_owned();
    };
    if !is_float || !v.is_finite() || v == 0.0 {
        return text.to_owned();
    }
    let a = v.abs();
    if !(1e-4..1e6).contains(&a) {
        return format!("{v:.3e}");
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let decimals = (3 - a.log10().floor() as i32).max(0) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothing_is_debiased_and_skips_non_finite_values() {
        // a constant stays constant from the first value on (no pull to 0)
        assert_eq!(smooth(&[2.0, 2.0, 2.0], 0.9), [2.0, 2.0, 2.0]);
        let s = smooth(&[1.0, f64::NAN, 3.0], 0.5);
        assert_eq!(s[0], 1.0);
        assert!(s[1].is_nan());
        // (0.5·0.5 + 0.5·3) / (1 − 0.25)
        assert!((s[2] - 1.75 / 0.75).abs() < 1e-12, "{s:?}");
        assert_eq!(smooth(&[1.0, 5.0], 0.0), [1.0, 5.0]);
    }

    #[test]
    fn the_inlier_range_leaves_out_the_first_steps_loss() {
        // a loss that falls from 5.6 to 2 in 5 of 100 steps, then 2 to 1.7
        let ys: Vec<f64> = (0..100)
            .map(|i| {
                let i = f64::from(i);
                if i < 5.0 {
                    5.6 - 0.72 * i
                } else {
                    2.0 - 0.003 * i
                }
            })
            .chain([f64::NAN])
            .collect();
        let (lo, hi) = inlier_range(&ys, false).unwrap();
        assert!(lo > 1.7 && lo < 1.8, "{lo}");
        assert!(hi > 1.97 && hi < 2.1, "{hi}");
        assert_eq!(inlier_range(&[f64::NAN], false), None);
        assert_eq!(inlier_range(&[-1.0, 0.0], true), None);
    }

    #[test]
    fn range_start_keeps_the_last_percent() {
        assert_eq!(range_start(0.0, 2000.0, 100), 0.0);
        assert_eq!(range_start(0.0, 2000.0, 20), 1600.0);
        assert_eq!(range_start(5.0, 5.0, 10), 5.0);
    }

    #[test]
    fn log_ticks_within_a_decade_and_over_many() {
        assert_eq!(log_ticks(1.6, 5.7), [2.0, 3.0, 4.0, 5.0]);
        assert_eq!(log_ticks(0.3, 30.0), [0.5, 1.0, 2.0, 5.0, 10.0, 20.0]);
        assert_eq!(
            log_ticks(1e-3, 1e4),
            [1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3, 1e4]
        );
        assert_eq!(log_ticks(1.55, 2.1), [1.6, 1.8, 2.0]);
        assert!(log_ticks(0.0, 1.0).is_empty());
    }

    #[test]
    fn tick_labels_share_decimals_on_a_linear_axis() {
        assert_eq!(
            tick_labels(&[1.6, 1.8, 2.0, 2.2], true),
            ["1.6", "1.8", "2.0", "2.2"]
        );
        assert_eq!(
            tick_labels(&[0.0, 0.002, 0.004], true),
            ["0", "0.002", "0.004"]
        );
        assert_eq!(tick_labels(&[2000.0, 4000.0], true), ["2000", "4000"]);
        assert_eq!(
            tick_labels(&log_ticks(0.3, 1.1), false),
            ["0.4", "0.6", "0.8", "1"]
        );
        assert_eq!(
            tick_labels(&[0.001, 1.0, 1000.0], false),
            ["0.001", "1", "1000"]
        );
        assert_eq!(tick_labels(&[0.0, 2e5], true), ["0", "2.0e5"]);
    }

    #[test]
    fn tokens_per_step_from_the_config() {
        let c = "[model]\nblock_size = 64\n\n[train]\nsteps = 2000\nbatch_size = 32\n";
        assert_eq!(tokens_per_step(c), Some(2048));
        assert_eq!(tokens_per_step("[train]\nbatch_size = 32\n"), None);
        assert_eq!(
            tokens_per_step("[other]\nbatch_size = 3\nblock_size = 4\n"),
            None
        );
    }

    #[test]
    fn counts_and_numbers_for_reading() {
        assert_eq!(fmt_count(950.0), "950");
        assert_eq!(fmt_count(2048.0), "2.05k");
        assert_eq!(fmt_count(4_096_000.0), "4.10M");
        assert_eq!(fmt_count(123_456_789.0), "123M");
        assert_eq!(short_number("1.7366004339521750"), "1.737");
        assert_eq!(short_number("5.598353492328897"), "5.598");
        assert_eq!(short_number("0.000123456"), "0.0001235");
        assert_eq!(short_number("2.5"), "2.5");
        assert_eq!(short_number("1234.5678"), "1235");
        assert_eq!(short_number("2.5e-7"), "2.500e-7");
        assert_eq!(short_number("42"), "42");
        assert_eq!(short_number("signal 9"), "signal 9");
        assert_eq!(short_number("NaN"), "NaN");
        assert_eq!(short_number("[1,2]"), "[1,2]");
    }
}
