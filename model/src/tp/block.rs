//! One tensor-parallel GPT-2 block on one rank.

use std::ops::Range;

use weft_collectives::{Communicator, CommunicatorExt};
use weft_kernels::{
    Mode, attention_backward, attention_forward, gelu_backward, gelu_forward, layernorm_backward,
    layernorm_forward, matmul_backward, matmul_forward, residual_forward,
};

use super::{CommClock, Result, TpOptions, check_len};
use crate::config::GptConfig;

/// Offsets of one block's local tensors relative to the block's first
/// parameter in the shard buffer (the order of [`super::TpLayout`]).
#[derive(Clone, Debug)]
pub(crate) struct TpBlock {
    pub(crate) c: usize,
    pub(crate) nh_l: usize,
    pub(crate) cl: usize,
    pub(crate) fl: usize,
    pub(crate) tp: usize,
    pub(crate) eps: f32,
    ln1_w: Range<usize>,
    ln1_b: Range<usize>,
    qkv_w: Range<usize>,
    qkv_b: Range<usize>,
    proj_w: Range<usize>,
    proj_b: Range<usize>,
    pub(crate) ln2_w: Range<usize>,
    ln2_b: Range<usize>,
    fc_w: Range<usize>,
    fc_b: Range<usize>,
    fcp_w: Range<usize>,
    fcp_b: Range<usize>,
    len: usize,
}

/// What a block's forward keeps for its backward on one rank. `ns` is the
/// number of tokens whose residual stream the rank holds (`B·T`, or
/// `B·T/tp` with sequence parallelism).
#[derive(Clone, Debug)]
pub(crate) struct TpBlockActs {
    pub(crate) ln1: Vec<f32>,      // (N, C), gathered in SP
    pub(crate) ln1_mean: Vec<f32>, // (ns)
    pub(crate) ln1_rstd: Vec<f32>, // (ns)
    pub(crate) qkv: Vec<f32>,      // (N, 3cl)
    pub(crate) atty: Vec<f32>,     // (N, cl)
    pub(crate) att: Vec<f32>,      // (B, nh_l, T, T)
    pub(crate) res2: Vec<f32>,     // (ns, C)
    pub(crate) ln2: Vec<f32>,      // (N, C), gathered in SP
    pub(crate) ln2_mean: Vec<f32>, // (ns)
    pub(crate) ln2_rstd: Vec<f32>, // (ns)
    pub(crate) fch: Vec<f32>,      // (N, fl)
    pub(crate) fch_gelu: Vec<f32>, // (N, fl)
    pub(crate) out: Vec<f32>,      // (ns, C)
}

impl TpBlockActs {
    pub(crate) fn bytes(&self) -> usize {
        4 * [
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.atty,
            &self.att,
            &self.res2,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &self.fch_gelu,
            &self.out,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>()
    }
}

/// Working buffers shared by all blocks of one rank.
#[derive(Clone, Debug)]
pub(crate) struct TpScratch {
    pub(crate) tmp: Vec<f32>,   // (N, C) row-parallel partial / whole output
    pub(crate) tmp_s: Vec<f32>, // (ns, C) SP shard
    pub(crate) dfull: Vec<f32>, // (N, C) gathered gradient (SP)
    pub(crate) dln: Vec<f32>,   // (N, C)
    pub(crate) dln_s: Vec<f32>, // (ns, C) (SP)
    datty: Vec<f32>,            // (N, cl)
    dqkv: Vec<f32>,             // (N, 3cl)
    datt: Vec<f32>,             // (B, nh_l, T, T)
    dgelu: Vec<f32>,            // (N, fl)
    dfch: Vec<f32>,             // (N, fl)
}

impl TpScratch {
    pub(crate) fn bytes(&self) -> usize {
        4 * [
            &self.tmp,
            &self.tmp_s,
            &self.dfull,
            &self.dln,
            &self.dln_s,
            &self.datty,
            &self.dqkv,
            &self.datt,
            &self.dgelu,
            &self.dfch,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>()
    }
}

/// The batch shape of a call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) sp: bool,
    pub(crate) tp: usize,
}

impl Shape {
    pub(crate) fn n(&self) -> usize {
        self.b * self.t
    }
    pub(crate) fn ns(&self) -> usize {
        if self.sp {
            self.n() / self.tp
        } else {
            self.n()
        }
    }
}

/// The communication of one rank, timed.
pub(crate) struct Link<'a> {
    pub(crate) comm: &'a dyn Communicator,
    pub(crate) opts: TpOptions,
    pub(crate) clock: &'a CommClock,
}

impl Link<'_> {
    pub(crate) fn all_reduce(&self, x: &mut [f32]) -> Result<()> {
        self.clock
            .time(|| self.comm.all_reduce_with(x, &self.opts.sum()))?;
        Ok(())
    }
    pub(crate) fn all_reduce_max(&self, x: &mut [f32]) -> Result<()> {
        self.clock
            .time(|| self.comm.all_reduce_with(x, &self.opts.max()))?;
        Ok(())
    }
    pub(crate) fn all_gather(&self, shard: &[f32], full: &mut [f32]) -> Result<()> {
        self.clock
            .time(|| self.comm.all_gather_with(shard, full, self.opts.algorithm))?;
        Ok(())
    }
    pub(crate) fn reduce_scatter(&self, full: &[f32], shard: &mut [f32]) -> Result<()> {
        self.clock
            .time(|| self.comm.reduce_scatter_with(full, shard, &self.opts.sum()))?;
        Ok(())
    }
}

fn add_bias(out: &mut [f32], b: &[f32]) {
    for row in out.chunks_exact_mut(b.len()) {
        for (o, &x) in row.iter_mut().zip(b) {
            *o += x;
        }
    }
}

impl TpBlock {
    pub(crate) fn new(cfg: &GptConfig, tp: usize) -> Self {
        let c = cfg.n_embd;
        let (cl, fl) = (c / tp, 4 * c / tp);
        let mut at = 0;
        let mut next = |n: usize| {
            let r = at..at + n;
            at += n;
            r
        };
        let (ln1_w, ln1_b) = (next(c), next(c));
        let (qkv_w, qkv_b) = (next(c * 3 * cl), next(3 * cl));
        let (proj_w, proj_b) = (next(cl * c), next(c));
        let (ln2_w, ln2_b) = (next(c), next(c));
        let (fc_w, fc_b) = (next(c * fl), next(fl));
        let (fcp_w, fcp_b) = (next(fl * c), next(c));
        TpBlock {
            c,
            nh_l: cfg.n_head / tp,
            cl,
            fl,
            tp,
            eps: cfg.layer_norm_epsilon,
            ln1_w,
            ln1_b,
            qkv_w,
            qkv_b,
            proj_w,
            proj_b,
            ln2_w,
            ln2_b,
            fc_w,
            fc_b,
            fcp_w,
            fcp_b,
            len: at,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The layernorm parameters' ranges (whose gradients are partial under
    /// sequence parallelism): `ln_1` weight+bias, `ln_2` weight+bias.
    pub(crate) fn ln_ranges(&self) -> [Range<usize>; 2] {
        [
            self.ln1_w.start..self.ln1_b.end,
            self.ln2_w.start..self.ln2_b.end,
        ]
    }

    pub(crate) fn acts(&self, s: Shape) -> TpBlockActs {
        let (n, ns, c) = (s.n(), s.ns(), self.c);
        let z = |k: usize| vec![0.0f32; k];
        TpBlockActs {
            ln1: z(n * c),
            ln1_mean: z(ns),
            ln1_rstd: z(ns),
            qkv: z(n * 3 * self.cl),
            atty: z(n * self.cl),
            att: z(s.b * self.nh_l * s.t * s.t),
            res2: z(ns * c),
            ln2: z(n * c),
            ln2_mean: z(ns),
            ln2_rstd: z(ns),
            fch: z(n * self.fl),
            fch_gelu: z(n * self.fl),
            out: z(ns * c),
        }
    }

    pub(crate) fn scratch(&self, s: Shape) -> TpScratch {
        let (n, ns, c) = (s.n(), s.ns(), self.c);
        let sp = |k: usize| if s.sp { vec![0.0f32; k] } else { Vec::new() };
        TpScratch {
            tmp: vec![0.0; n * c],
            tmp_s: sp(ns * c),
            dfull: sp(n * c),
            dln: vec![0.0; n * c],
            dln_s: sp(ns * c),
            datty: vec![0.0; n * self.cl],
            dqkv: vec![0.0; n * 3 * self.cl],
            datt: vec![0.0; s.b * self.nh_l * s.t * s.t],
            dgelu: vec![0.0; n * self.fl],
            dfch: vec![0.0; n * self.fl],
        }
    }

    /// Layernorm of the rank's tokens `inp (ns, C)` into `out (N, C)`
    /// (all-gathered with sequence parallelism).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layernorm_gather(
        &self,
        link: &Link<'_>,
        s: Shape,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        w: &[f32],
        b: &[f32],
        shard: &mut [f32],
    ) -> Result<()> {
        let (ns, c) = (s.ns(), self.c);
        if s.sp {
            layernorm_forward(shard, mean, rstd, inp, w, b, ns, c, self.eps)?;
            link.all_gather(shard, out)
        } else {
            layernorm_forward(out, mean, rstd, inp, w, b, ns, c, self.eps)?;
            Ok(())
        }
    }

    /// Row-parallel layer `inp (N, k) · w + b` into the rank's tokens of
    /// the sum: `scratch.tmp` (N, C) without sequence parallelism,
    /// `scratch.tmp_s` (ns, C) with.
    #[allow(clippy::too_many_arguments)]
    fn row_parallel(
        &self,
        link: &Link<'_>,
        s: Shape,
        scratch: &mut TpScratch,
        inp: &[f32],
        w: &[f32],
        bias: &[f32],
        k: usize,
    ) -> Result<()> {
        let fused = (self.tp == 1).then_some(bias);
        matmul_forward(
            &mut scratch.tmp,
            inp,
            w,
            fused,
            s.b,
            s.t,
            k,
            self.c,
            Mode::Throughput,
        )?;
        let out = if s.sp {
            link.reduce_scatter(&scratch.tmp, &mut scratch.tmp_s)?;
            &mut scratch.tmp_s
        } else {
            link.all_reduce(&mut scratch.tmp)?;
            &mut scratch.tmp
        };
        if fused.is_none() {
            add_bias(out, bias);
        }
        Ok(())
    }

    /// The block's forward over the rank's tokens `inp (ns, C)`; the output
    /// is `acts.out (ns, C)`.
    pub(crate) fn forward(
        &self,
        link: &Link<'_>,
        s: Shape,
        acts: &mut TpBlockActs,
        inp: &[f32],
        p: &[f32],
        scratch: &mut TpScratch,
    ) -> Result<()> {
        check_len("tp block parameters", p.len(), self.len)?;
        let (b, t, c, ns) = (s.b, s.t, self.c, s.ns());
        self.layernorm_gather(
            link,
            s,
            &mut acts.ln1,
            &mut acts.ln1_mean,
            &mut acts.ln1_rstd,
            inp,
            &p[self.ln1_w.clone()],
            &p[self.ln1_b.clone()],
            &mut scratch.tmp_s,
        )?;
        // Column-parallel QKV over the local heads (f: identity).
        matmul_forward(
            &mut acts.qkv,
            &acts.ln1,
            &p[self.qkv_w.clone()],
            Some(&p[self.qkv_b.clone()]),
            b,
            t,
            c,
            3 * self.cl,
            Mode::BatchInvariant,
        )?;
        attention_forward(
            &mut acts.atty,
            &mut acts.att,
            &acts.qkv,
            b,
            t,
            self.cl,
            self.nh_l,
        )?;
        self.row_parallel(
            link,
            s,
            scratch,
            &acts.atty,
            &p[self.proj_w.clone()],
            &p[self.proj_b.clone()],
            self.cl,
        )?;
        let y = if s.sp { &scratch.tmp_s } else { &scratch.tmp };
        residual_forward(&mut acts.res2, inp, y, ns * c)?;
        self.layernorm_gather(
            link,
            s,
            &mut acts.ln2,
            &mut acts.ln2_mean,
            &mut acts.ln2_rstd,
            &acts.res2,
            &p[self.ln2_w.clone()],
            &p[self.ln2_b.clone()],
            &mut scratch.tmp_s,
        )?;
        matmul_forward(
            &mut acts.fch,
            &acts.ln2,
            &p[self.fc_w.clone()],
            Some(&p[self.fc_b.clone()]),
            b,
            t,
            c,
            self.fl,
            Mode::Throughput,
        )?;
        gelu_forward(&mut acts.fch_gelu, &acts.fch, s.n() * self.fl)?;
        self.row_parallel(
            link,
            s,
            scratch,
            &acts.fch_gelu,
            &p[self.fcp_w.clone()],
            &p[self.fcp_b.clone()],
            self.fl,
        )?;
        let y = if s.sp { &scratch.tmp_s } else { &scratch.tmp };
        residual_forward(&mut acts.out, &acts.res2, y, ns * c)?;
        Ok(())
    }

    /// The block's backward: on entry `dres (ns, C)` is the gradient of the
    /// block's output (the rank's tokens), on return that of its input
    /// `inp`; the rank's parameter gradients are accumulated into `g`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward(
        &self,
        link: &Link<'_>,
        s: Shape,
        dres: &mut [f32],
        g: &mut [f32],
        acts: &TpBlockActs,
        inp: &[f32],
        p: &[f32],
        scratch: &mut TpScratch,
    ) -> Result<()> {
        check_len("tp block parameters", p.len(), self.len)?;
        check_len("tp block gradients", g.len(), self.len)?;
        let (b, t, c, ns) = (s.b, s.t, self.c, s.ns());
        let mode = Mode::Throughput;
        // MLP: c_proj is row-parallel; its input gradient needs the whole
        // output gradient (all-gathered under SP, replicated otherwise).
        if s.sp {
            link.all_gather(dres, &mut scratch.dfull)?;
        }
        {
            let dout: &[f32] = if s.sp { &scratch.dfull } else { dres };
            weft_kernels::zero(&mut scratch.dgelu);
            weft_kernels::zero(&mut scratch.dfch);
            let (dw, db) = two_mut(g, self.fcp_w.clone(), self.fcp_b.clone());
            matmul_backward(
                &mut scratch.dgelu,
                dw,
                Some(db),
                dout,
                &acts.fch_gelu,
                &p[self.fcp_w.clone()],
                b,
                t,
                self.fl,
                c,
                mode,
            )?;
        }
        gelu_backward(
            &mut scratch.dfch,
            &acts.fch,
            &scratch.dgelu,
            s.n() * self.fl,
        )?;
        weft_kernels::zero(&mut scratch.dln);
        let (dw, db) = two_mut(g, self.fc_w.clone(), self.fc_b.clone());
        matmul_backward(
            &mut scratch.dln,
            dw,
            Some(db),
            &scratch.dfch,
            &acts.ln2,
            &p[self.fc_w.clone()],
            b,
            t,
            c,
            self.fl,
            mode,
        )?;
        // f's backward: sum the partial input gradients of c_fc.
        let dln = self.reduce_dln(link, s, scratch)?;
        let (dw, db) = two_mut(g, self.ln2_w.clone(), self.ln2_b.clone());
        layernorm_backward(
            dres,
            dw,
            db,
            dln,
            &acts.res2,
            &p[self.ln2_w.clone()],
            &acts.ln2_mean,
            &acts.ln2_rstd,
            ns,
            c,
        )?;
        // Attention.
        if s.sp {
            link.all_gather(dres, &mut scratch.dfull)?;
        }
        {
            let dout: &[f32] = if s.sp { &scratch.dfull } else { dres };
            weft_kernels::zero(&mut scratch.datty);
            let (dw, db) = two_mut(g, self.proj_w.clone(), self.proj_b.clone());
            matmul_backward(
                &mut scratch.datty,
                dw,
                Some(db),
                dout,
                &acts.atty,
                &p[self.proj_w.clone()],
                b,
                t,
                self.cl,
                c,
                mode,
            )?;
        }
        weft_kernels::zero(&mut scratch.dqkv);
        attention_backward(
            &mut scratch.dqkv,
            &mut scratch.datt,
            &scratch.datty,
            &acts.qkv,
            &acts.att,
            b,
            t,
            self.cl,
            self.nh_l,
        )?;
        weft_kernels::zero(&mut scratch.dln);
        let (dw, db) = two_mut(g, self.qkv_w.clone(), self.qkv_b.clone());
        matmul_backward(
            &mut scratch.dln,
            dw,
            Some(db),
            &scratch.dqkv,
            &acts.ln1,
            &p[self.qkv_w.clone()],
            b,
            t,
            c,
            3 * self.cl,
            mode,
        )?;
        let dln = self.reduce_dln(link, s, scratch)?;
        let (dw, db) = two_mut(g, self.ln1_w.clone(), self.ln1_b.clone());
        layernorm_backward(
            dres,
            dw,
            db,
            dln,
            inp,
            &p[self.ln1_w.clone()],
            &acts.ln1_mean,
            &acts.ln1_rstd,
            ns,
            c,
        )?;
        Ok(())
    }

    /// The `f` operator's backward on `scratch.dln (N, C)`: all-reduce, or
    /// reduce-scatter into `scratch.dln_s` under SP; returns the rank's
    /// tokens of the summed gradient.
    pub(crate) fn reduce_dln<'s>(
        &self,
        link: &Link<'_>,
        s: Shape,
        scratch: &'s mut TpScratch,
    ) -> Result<&'s [f32]> {
        if s.sp {
            link.reduce_scatter(&scratch.dln, &mut scratch.dln_s)?;
            Ok(&scratch.dln_s)
        } else {
            link.all_reduce(&mut scratch.dln)?;
            Ok(&scratch.dln)
        }
    }
}

pub(crate) fn two_mut(
    buf: &mut [f32],
    a: Range<usize>,
    b: Range<usize>,
) -> (&mut [f32], &mut [f32]) {
    debug_assert!(a.end <= b.start);
    let (lo, hi) = buf.split_at_mut(b.start);
    (&mut lo[a], &mut hi[..b.end - b.start])
}
