//! AdamW over a layout of shards: the one optimizer of every layout.

use std::ops::Range;

use weft_kernels::{AdamW, adamw_update};

use crate::error::{Result, layout_err};

/// One AdamW step at optimizer step `step` (from 1) over the runs
/// `(range, decay)` of the buffers — a layout's tensors
/// ([`ParamLayout::decay_runs`](crate::ParamLayout::decay_runs)), or the
/// pieces of them an FSDP shard holds. Every range is checked before
/// anything is updated, so a bad layout changes nothing.
///
/// # Errors
/// [`Error::Layout`](crate::Error::Layout) naming the first run outside the
/// buffers; a kernel error otherwise.
pub fn adamw_runs<I>(
    runs: I,
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamW,
    step: u32,
) -> Result<()>
where
    I: IntoIterator<Item = (Range<usize>, bool)> + Clone,
{
    let len = params.len().min(grads.len()).min(m.len()).min(v.len());
    if let Some((r, _)) = runs.clone().into_iter().find(|(r, _)| r.end > len) {
        return Err(layout_err(
            format!("AdamW run {r:?}"),
            format!(
                "outside buffers of {} parameters, {} gradients and {}/{} moments",
                params.len(),
                grads.len(),
                m.len(),
                v.len()
            ),
        ));
    }
    for (r, decay) in runs {
        adamw_update(
            &mut params[r.clone()],
            &grads[r.clone()],
            &mut m[r.clone()],
            &mut v[r],
            hp,
            step,
            decay,
        )?;
    }
    Ok(())
}

/// AdamW moments for a buffer (same layout as its parameters) and the
/// number of steps taken.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWState {
    /// First moments.
    pub m: Vec<f32>,
    /// Second moments.
    pub v: Vec<f32>,
    /// Steps taken so far.
    pub step: u32,
}

impl AdamWState {
    /// Zero moments for `len` parameters.
    pub fn zeros(len: usize) -> Self {
        AdamWState {
            m: vec![0.0; len],
            v: vec![0.0; len],
            step: 0,
        }
    }

    /// Parameters the moments cover.
    pub fn len(&self) -> usize {
        self.m.len()
    }

    /// Whether the moments cover nothing.
    pub fn is_empty(&self) -> bool {
        self.m.is_empty()
    }

    /// Counts one step and runs [`adamw_runs`] over `runs` with it; the
    /// count is kept only if the update ran.
    ///
    /// # Errors
    /// As [`adamw_runs`].
    pub fn step<I>(&mut self, runs: I, params: &mut [f32], grads: &[f32], hp: &AdamW) -> Result<()>
    where
        I: IntoIterator<Item = (Range<usize>, bool)> + Clone,
    {
        adamw_runs(
            runs,
            params,
            grads,
            &mut self.m,
            &mut self.v,
            hp,
            self.step + 1,
        )?;
        self.step += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_run_changes_nothing() {
        let mut st = AdamWState::zeros(4);
        let mut p = vec![1.0f32; 4];
        let g = vec![0.5f32; 4];
        let hp = AdamW::default();
        let e = st
            .step([(0..2, true), (2..5, false)], &mut p, &g, &hp)
            .unwrap_err();
        assert!(e.to_string().contains("2..5"), "{e}");
        assert_eq!((p, st.step), (vec![1.0; 4], 0));
    }

    #[test]
    fn decay_applies_where_the_mask_says() {
        let mut st = AdamWState::zeros(2);
        let mut p = vec![1.0f32; 2];
        let hp = AdamW {
            lr: 0.1,
            weight_decay: 0.5,
            ..AdamW::default()
        };
        st.step([(0..1, true), (1..2, false)], &mut p, &[0.0, 0.0], &hp)
            .unwrap();
        assert_eq!(p, [0.95, 1.0]);
        assert_eq!(st.step, 1);
    }
}
