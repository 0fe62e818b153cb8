//! The executor over stages that are not weft's GPT: the MLP stack of
//! `examples/mlp_stack.rs` trained over 1, 2 and 4 thread ranks (bitwise
//! the one-rank losses), a shared parameter between the first and last
//! stage (tied weights), a forward-only schedule, and the errors.

#[path = "../examples/mlp_stack.rs"]
mod mlp_stack;

use std::ops::Range;

use weft_collectives::{Communicator, LocalCluster};
use weft_pipeline::{ExecError, Executor, Placement, Schedule, ScheduleKind, Shared, Stage};

#[test]
fn an_mlp_stack_trains_bitwise_like_one_rank_on_every_schedule() {
    let rows = mlp_stack::run().unwrap();
    assert_eq!(rows.len(), 6);
}

/// `y = w·x` per element; the first virtual stage owns `w` (its parameter
/// 0) and the last uses a copy of it as its own scale, so `w` is shared;
/// the loss is `mean(y)` of the last stage.
#[derive(Debug)]
struct Scale {
    first: bool,
    last: bool,
    nvs: usize,
    vs: usize,
    /// Own weight (the shared one on the first stage).
    w: f32,
    /// The last stage's copy of the shared weight.
    copy: f32,
    g: Vec<f32>,
    x: Vec<Option<Vec<f32>>>,
    shared_out: Vec<f32>,
    shared_in: Option<f32>,
    fail_on: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
#[error("scale stage: {0}")]
struct ScaleError(String);

const LEN: usize = 4;

impl Scale {
    fn new(vs: usize, nvs: usize, m: usize) -> Self {
        Scale {
            first: vs == 0,
            last: vs + 1 == nvs,
            nvs,
            vs,
            w: 1.5 + vs as f32 * 0.25,
            copy: 1.5,
            g: vec![0.0],
            x: vec![None; m],
            shared_out: vec![0.0],
            shared_in: None,
            fail_on: None,
        }
    }
    fn scale(&self) -> f32 {
        if self.last { self.copy } else { self.w }
    }
}

impl Stage for Scale {
    type Batch<'a> = Vec<f32>;
    type Error = ScaleError;
    fn input_len(&self) -> usize {
        LEN
    }
    fn output_len(&self) -> usize {
        LEN
    }
    fn slots(&self) -> usize {
        self.x.len()
    }
    fn splits_backward(&self) -> bool {
        false
    }
    fn forward(
        &mut self,
        mb: usize,
        batch: &Vec<f32>,
        input: Option<&[f32]>,
        output: Option<&mut [f32]>,
    ) -> Result<Option<f64>, ScaleError> {
        if self.fail_on == Some(mb) {
            return Err(ScaleError(format!("micro-batch {mb} refused")));
        }
        let x = input.unwrap_or(batch).to_vec();
        let y: Vec<f32> = x.iter().map(|v| self.scale() * v).collect();
        self.x[mb] = Some(x);
        if let Some(o) = output {
            o.copy_from_slice(&y);
        }
        Ok(self
            .last
            .then(|| y.iter().map(|&v| f64::from(v)).sum::<f64>() / LEN as f64))
    }
    fn backward(
        &mut self,
        mb: usize,
        dout: Option<&[f32]>,
        dinput: Option<&mut [f32]>,
    ) -> Result<Vec<Range<usize>>, ScaleError> {
        let x = self.x[mb]
            .take()
            .ok_or_else(|| ScaleError(format!("backward of {mb} without forward")))?;
        let dy = dout.map_or(vec![1.0 / LEN as f32; LEN], <[f32]>::to_vec);
        let dw: f32 = dy.iter().zip(&x).map(|(d, v)| d * v).sum();
        if self.last {
            self.shared_out[0] = dw; // the copy's gradient goes to the owner
        } else {
            if self.first {
                let g = self
                    .shared_in
                    .take()
                    .ok_or_else(|| ScaleError("the user's gradient did not arrive".into()))?;
                self.g[0] += g;
            }
            self.g[0] += dw;
        }
        if let Some(d) = dinput {
            d.iter_mut()
                .zip(&dy)
                .for_each(|(o, g)| *o = self.scale() * g);
        }
        Ok(std::iter::once(0..1).collect())
    }
    fn backward_input(
        &mut self,
        _: usize,
        _: Option<&[f32]>,
        _: Option<&mut [f32]>,
    ) -> Result<Vec<Range<usize>>, ScaleError> {
        Err(ScaleError("no split backward".into()))
    }
    fn backward_weight(&mut self, _: usize) -> Result<Vec<Range<usize>>, ScaleError> {
        Err(ScaleError("no split backward".into()))
    }
    fn discard(&mut self, mb: usize) -> Result<(), ScaleError> {
        self.x[mb] = None;
        Ok(())
    }
    fn grads(&self) -> &[f32] {
        &self.g
    }
    fn grads_mut(&mut self) -> &mut [f32] {
        &mut self.g
    }
    fn shared(&self) -> Vec<Shared> {
        if self.first || self.last {
            vec![Shared {
                id: 0,
                owner: 0,
                user: self.nvs - 1,
                len: 1,
            }]
        } else {
            Vec::new()
        }
    }
    fn shared_grad(&self, _: u32, _: usize) -> Option<&[f32]> {
        self.last.then_some(self.shared_out.as_slice())
    }
    fn add_shared_grad(&mut self, _: u32, _: usize, g: &[f32]) -> Result<(), ScaleError> {
        self.shared_in = Some(g[0]);
        Ok(())
    }
    fn shared_param(&self, _: u32) -> Option<&[f32]> {
        self.first.then_some(std::slice::from_ref(&self.w))
    }
    fn set_shared_param(&mut self, _: u32, v: &[f32]) -> Result<(), ScaleError> {
        if self.vs + 1 != self.nvs {
            return Err(ScaleError("not the user".into()));
        }
        self.copy = v[0];
        Ok(())
    }
}

fn data(m: usize) -> Vec<Vec<f32>> {
    (0..m)
        .map(|k| (0..LEN).map(|i| (k * LEN + i) as f32 * 0.1 - 0.3).collect())
        .collect()
}

/// The loss of micro-batch `x` through the scales `ws`, serially.
fn serial(ws: &[f32], x: &[f32]) -> f64 {
    let mut h = x.to_vec();
    for &w in ws {
        h.iter_mut().for_each(|v| *v *= w);
    }
    h.iter().map(|&v| f64::from(v)).sum::<f64>() / LEN as f64
}

#[test]
fn a_shared_parameter_gets_both_stages_gradients_and_is_synced_back() {
    let (p, m) = (3, 4);
    let d = data(m);
    let schedule = ScheduleKind::OneFOneB.generate(p, m, 1).unwrap();
    let out = LocalCluster::run(
        p,
        |comm| -> Result<(Vec<Option<f64>>, f32, f32), ExecError> {
            let mut ex = Executor::new(
                schedule.clone(),
                comm.rank(),
                vec![Scale::new(comm.rank(), p, m)],
            )?;
            let report = ex.step(&comm, &d, None)?;
            let g = ex.stages()[0].g[0];
            // an optimizer step on the owner, then the copy follows
            if comm.rank() == 0 {
                ex.stages_mut()[0].w = 9.0;
            }
            ex.sync_shared(&comm)?;
            Ok((report.losses, g, ex.stages()[0].copy))
        },
    )
    .unwrap();
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    let ws = [1.5f32, 1.75, 1.5];
    // d loss/d w0 = Σ_mb mean(dy · x) at both uses: at the first stage the
    // upstream gradient is w1·w0/LEN, at the last the input is w0·w1·x.
    let mut want_g0 = 0.0f32;
    for (k, x) in d.iter().enumerate() {
        let loss = serial(&ws, x);
        assert_eq!(out[p - 1].0[k].map(f64::to_bits), Some(loss.to_bits()));
        let first: f32 = x.iter().map(|v| (ws[2] * ws[1] / LEN as f32) * v).sum();
        let last: f32 = x
            .iter()
            .map(|v| (1.0 / LEN as f32) * (ws[1] * (ws[0] * v)))
            .sum();
        want_g0 += last;
        want_g0 += first;
    }
    assert!(
        (out[0].1 - want_g0).abs() <= 1e-6 * want_g0.abs(),
        "{} vs {want_g0}",
        out[0].1
    );
    assert_eq!(
        out[p - 1].2,
        9.0,
        "the user's copy follows the owner after sync"
    );
    // the middle stage holds no shared parameter and is untouched
    assert_eq!(out[1].2, 1.5);
}

#[test]
fn a_forward_only_schedule_evaluates_a_pipelined_model_in_place() {
    let (p, m) = (2, 5);
    let d = data(m);
    let schedule = Schedule::forward_only(
        Placement::Interleaved {
            stages: p,
            chunks: 1,
        },
        m,
    )
    .unwrap();
    weft_pipeline::validate(&schedule).unwrap();
    assert!(schedule.is_forward_only());
    assert_eq!(schedule.peak_in_flight(), [1, 1]);
    let out = LocalCluster::run(p, |comm| -> Result<Vec<Option<f64>>, ExecError> {
        let st = Scale::new(comm.rank(), p, m);
        let mut ex = Executor::new(schedule.clone(), comm.rank(), vec![st])?;
        let r = ex.step(&comm, &d, None)?;
        assert!(ex.stages()[0].x.iter().all(Option::is_none), "discarded");
        Ok(r.losses)
    })
    .unwrap();
    let losses = out.into_iter().nth(p - 1).unwrap().unwrap();
    for (k, x) in d.iter().enumerate() {
        let want = serial(&[1.5, 1.5], x);
        assert_eq!(losses[k].map(f64::to_bits), Some(want.to_bits()));
    }
    // and two chunks per stage, interleaved or in a V
    for placement in [
        Placement::Interleaved {
            stages: 2,
            chunks: 2,
        },
        Placement::VShape { stages: 2 },
    ] {
        let s = Schedule::forward_only(placement, 3).unwrap();
        weft_pipeline::validate(&s).unwrap();
        assert_eq!(s.placement(), placement);
    }
}

#[test]
fn bad_setups_are_typed_errors() {
    let s = ScheduleKind::OneFOneB.generate(2, 4, 1).unwrap();
    let e = Executor::new(s.clone(), 2, vec![Scale::new(0, 2, 4)]).unwrap_err();
    assert!(matches!(e, ExecError::Setup { .. }), "{e}");
    let e =
        Executor::new(s.clone(), 0, vec![Scale::new(0, 2, 4), Scale::new(1, 2, 4)]).unwrap_err();
    assert!(e.to_string().contains("chunks"), "{e}");
    let mut small = Scale::new(0, 2, 4);
    small.x.truncate(1);
    let e = Executor::new(s.clone(), 0, vec![small]).unwrap_err();
    assert!(e.to_string().contains("slots"), "{e}");
    let zb = ScheduleKind::ZbH1.generate(2, 4, 1).unwrap();
    let e = Executor::new(zb, 0, vec![Scale::new(0, 2, 4)]).unwrap_err();
    assert!(e.to_string().contains("splits the backward"), "{e}");
    // a wrong number of micro-batches at step time, on every rank
    let r = LocalCluster::run(2, |comm| {
        let mut ex =
            Executor::new(s.clone(), comm.rank(), vec![Scale::new(comm.rank(), 2, 4)]).unwrap();
        ex.step(&comm, &data(3), None).is_err()
    })
    .unwrap();
    assert_eq!(r, vec![true, true]);
}

#[test]
fn a_failing_stage_fails_its_peers_instead_of_hanging() {
    let s = ScheduleKind::OneFOneB.generate(2, 3, 1).unwrap();
    let d = data(3);
    let r = LocalCluster::builder(2)
        .timeout(std::time::Duration::from_secs(20))
        .run_each(|comm| {
            let mut st = Scale::new(comm.rank(), 2, 3);
            if comm.rank() == 0 {
                st.fail_on = Some(1);
            }
            let mut ex = Executor::new(s.clone(), comm.rank(), vec![st]).unwrap();
            ex.step(&comm, &d, None)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
    let errs: Vec<String> = r.into_iter().map(|x| x.unwrap().unwrap_err()).collect();
    assert!(
        errs[0].contains("rank 0") && errs[0].contains("F1") && errs[0].contains("refused"),
        "stage 0 names its action and its stage's error: {}",
        errs[0]
    );
    assert!(errs[1].contains("rank 1"), "stage 1 fails too: {}", errs[1]);
}
