use weft_collectives::LocalCluster;
use weft_moe::{AuxLoss, Expert, ExpertParallel, MoeBlock, MoeConfig, Router};

use crate::Rng;

/// ep = 2 and ep = 4 give the same outputs, input gradients and parameter
/// gradients as the unsharded block (ep = 1) run on each rank's tokens.
#[test]
fn expert_parallel_matches_ep1() {
    let gelu = MoeConfig {
        channels: 6,
        hidden: 10,
        router: Router::top_k(8, 2).with_normalize(true),
        expert: Expert::Gelu,
        shared_experts: 1,
        aux: Some(AuxLoss::new(0.05)),
    };
    // Fine-grained SwiGLU experts, two shared, scaled gates.
    let swiglu = MoeConfig {
        hidden: 4,
        router: gelu.router.with_scale(2.5),
        expert: Expert::SwiGlu,
        shared_experts: 2,
        ..gelu
    };
    for cfg in [gelu, swiglu] {
        expert_parallel_matches_ep1_for(cfg);
    }
}

fn expert_parallel_matches_ep1_for(cfg: MoeConfig) {
    let block = MoeBlock::new(cfg).unwrap();
    let mut full = vec![0.0f64; block.num_params()];
    block.init(&mut full, 17, 1.0).unwrap();
    for p in &mut full {
        *p *= 10.0;
    }
    let lens = [5, 6];
    let n = 11;
    let c = cfg.channels;
    for ep in [2usize, 4] {
        let data: Vec<(Vec<f64>, Vec<f64>)> = (0..ep)
            .map(|r| {
                let mut rng = Rng::new(100 + r as u64);
                (rng.vec(n * c, 1.0), rng.vec(n * c, 1.0))
            })
            .collect();
        // Reference: ep = 1 per rank; expert gradients summed over ranks.
        let mut ref_out = Vec::new();
        let mut ref_dinp = Vec::new();
        let mut ref_dparams = Vec::new();
        let mut expert_grad_sum = vec![0.0; full.len()];
        for (inp, dout) in &data {
            let mut out = vec![0.0; n * c];
            let mut saved = vec![0.0; n * cfg.saved_per_token()];
            block
                .forward(&mut out, &mut saved, inp, &full, &lens)
                .unwrap();
            let mut dinp = vec![0.0; n * c];
            let mut dp = vec![0.0; full.len()];
            block
                .backward(&mut dinp, &mut dp, dout, inp, &saved, &full, &lens)
                .unwrap();
            for (a, b) in expert_grad_sum.iter_mut().zip(&dp) {
                *a += b;
            }
            ref_out.push(out);
            ref_dinp.push(dinp);
            ref_dparams.push(dp);
        }
        let results = LocalCluster::run(ep, |comm| {
            let rank = weft_collectives::Communicator::rank(&comm);
            let epb = ExpertParallel::new(cfg, ep, rank).unwrap();
            let params = epb.shard(&full).unwrap();
            let (inp, dout) = &data[rank];
            let mut out = vec![0.0; n * c];
            let (fwd, saved) = epb.forward(&comm, &mut out, inp, &params, &lens).unwrap();
            let mut dinp = vec![0.0; n * c];
            let mut dp = vec![0.0; params.len()];
            epb.backward(&comm, &mut dinp, &mut dp, dout, inp, &saved, &params, &lens)
                .unwrap();
            (out, dinp, dp, fwd)
        })
        .unwrap();
        let close = |a: &[f64], b: &[f64], what: &str| {
            assert_eq!(a.len(), b.len(), "{what}");
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-12, "ep={ep} {what}: {worst}");
        };
        for (rank, (out, dinp, dp, _fwd)) in results.iter().enumerate() {
            close(out, &ref_out[rank], "out");
            close(dinp, &ref_dinp[rank], "dinp");
            // Router and shared expert: this rank's tokens; experts: the
            // sum over all ranks' tokens of this rank's experts.
            let epb = ExpertParallel::new(cfg, ep, rank).unwrap();
            let mut want = epb.shard(&ref_dparams[rank]).unwrap();
            let experts = epb.shard(&expert_grad_sum).unwrap();
            let mut off = 0;
            for t in cfg.tensors(epb.local_experts()) {
                let len = t.numel();
                if t.name.starts_with("experts.") {
                    want[off..off + len].copy_from_slice(&experts[off..off + len]);
                }
                off += len;
            }
            close(dp, &want, "dparams");
        }
    }
}

#[test]
fn ep_must_divide_experts() {
    let err = ExpertParallel::new(MoeConfig::new(4, 6, 2), 4, 0).unwrap_err();
    assert!(err.to_string().contains("parallel.ep"), "{err}");
}

/// The flat-buffer forward/backward (fixed activation size per token,
/// experts' hidden activations recomputed) gives bitwise the results of
/// the one keeping everything, in f32 and for every rank.
#[test]
fn flat_saved_recompute_is_bitwise_the_full_save() {
    let gelu = MoeConfig {
        channels: 8,
        hidden: 12,
        router: Router::top_k(8, 3)
            .with_gate(weft_moe::Gate::Sigmoid)
            .with_normalize(true),
        expert: Expert::Gelu,
        shared_experts: 1,
        aux: Some(AuxLoss::new(0.01)),
    };
    let swiglu = MoeConfig {
        hidden: 5,
        expert: Expert::SwiGlu,
        shared_experts: 2,
        ..gelu
    };
    for cfg in [gelu, swiglu] {
        flat_saved_recompute_is_bitwise_the_full_save_for(cfg);
    }
}

fn flat_saved_recompute_is_bitwise_the_full_save_for(cfg: MoeConfig) {
    let block = MoeBlock::new(cfg).unwrap();
    let mut full = vec![0.0f32; block.num_params()];
    block.init(&mut full, 5, 1.0).unwrap();
    for p in &mut full {
        *p *= 20.0;
    }
    let lens = [4, 7];
    let n = 11;
    let c = cfg.channels;
    let results = LocalCluster::run(4, |comm| {
        let rank = weft_collectives::Communicator::rank(&comm);
        let epb = ExpertParallel::new(cfg, 4, rank).unwrap();
        let params = epb.shard(&full).unwrap();
        let mut rng = Rng::new(7 + rank as u64);
        let inp: Vec<f32> = rng.vec(n * c, 1.0).iter().map(|&x| x as f32).collect();
        let dout: Vec<f32> = rng.vec(n * c, 1.0).iter().map(|&x| x as f32).collect();
        let mut out_a = vec![0.0f32; n * c];
        let (fa, saved) = epb
            .forward(&comm, &mut out_a, &inp, &params, &lens)
            .unwrap();
        let mut dinp_a = vec![0.0f32; n * c];
        let mut dp_a = vec![0.0f32; params.len()];
        epb.backward(
            &comm,
            &mut dinp_a,
            &mut dp_a,
            &dout,
            &inp,
            &saved,
            &params,
            &lens,
        )
        .unwrap();
        let mut out_b = vec![0.0f32; n * c];
        let mut flat = vec![0.0f32; n * epb.saved_per_token()];
        let fb = epb
            .forward_flat(&comm, &mut out_b, &mut flat, &inp, &params, &lens)
            .unwrap();
        let mut dinp_b = vec![0.0f32; n * c];
        let mut dp_b = vec![0.0f32; params.len()];
        epb.backward_flat(
            &comm,
            &mut dinp_b,
            &mut dp_b,
            &dout,
            &inp,
            &flat,
            &params,
            &lens,
        )
        .unwrap();
        let short = epb.forward_flat(&comm, &mut out_b, &mut flat[1..], &inp, &params, &lens);
        assert!(short.unwrap_err().to_string().contains("saved"));
        (out_a == out_b, dinp_a == dinp_b, dp_a == dp_b, fa == fb)
    })
    .unwrap();
    for (rank, r) in results.into_iter().enumerate() {
        assert_eq!(r, (true, true, true, true), "rank {rank}");
    }
}
