//! Expert parallelism through the model: a tiny MoE GPT whose experts are
//! sharded over an ep = 2 or ep = 4 group ([`MoeFfn::with_expert_parallel`]
//! over collectives' `LocalCluster`) gives each rank the loss, logits and
//! gradients of the unsharded model (ep = 1) run on that rank's tokens;
//! each rank's expert gradients are the sum over the group's ranks of the
//! unsharded model's gradients of its experts.
//!
//! Tolerance: 1e-5 of each tensor's largest magnitude (logits and every
//! gradient), 1e-6 relative for the loss, not bitwise. The math is the
//! same (the f64 test in weft-moe agrees to 1e-12), but under ep each
//! expert's GEMM runs over the rows of every rank of the group at once,
//! and the kernels' throughput GEMMs may round a row differently in the
//! last bit depending on the other rows of the call (`Mode::Throughput`:
//! "results may differ in the last bits between batch sizes"); expert
//! weight gradients also sum the ranks' rows in a different order. The
//! differences observed are ~1e-7 relative; the router is scaled up so that
//! no top-k choice is near a tie that such a difference could flip.

use std::sync::Arc;

use weft_model::{Gpt, GptConfig, MoeFfn};
use weft_moe::weft_collectives::{Communicator, LocalCluster};
use weft_moe::{AuxLoss, MoeConfig, Router};

const B: usize = 2;
const T: usize = 8;

fn gpt_config() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        vocab_size: 37,
        block_size: T,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    }
}

fn moe_config() -> MoeConfig {
    MoeConfig {
        router: Router::top_k(8, 2).with_normalize(true),
        shared_experts: 1,
        aux: Some(AuxLoss::new(0.01)),
        ..MoeConfig::new(16, 8, 2)
    }
}

/// The unsharded model, GPT-2-initialised with the router scaled up so the
/// routing is far from uniform.
fn full_model() -> Gpt {
    let (ffn, _) = MoeFfn::new(moe_config()).unwrap();
    let mut m = Gpt::with_ffn(gpt_config(), Box::new(ffn)).unwrap();
    m.init_gpt2(11);
    for spec in m.layout().specs().to_vec() {
        if spec.name.ends_with("mlp.router.weight") {
            m.params[spec.range()].iter_mut().for_each(|x| *x *= 50.0);
        }
    }
    m
}

fn batch(rank: usize) -> (Vec<u32>, Vec<u32>) {
    let v = gpt_config().vocab_size as u64;
    let mut s = 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(rank as u64 + 1);
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % v) as u32
    };
    let inputs: Vec<u32> = (0..B * T).map(|_| next()).collect();
    let targets: Vec<u32> = (0..B * T).map(|_| next()).collect();
    (inputs, targets)
}

struct Step {
    loss: f64,
    logits: Vec<f32>,
    grads: Vec<f32>,
}

fn step(model: &mut Gpt, rank: usize) -> Step {
    let (inputs, targets) = batch(rank);
    let mut acts = model.activations(B, T).unwrap();
    model.zero_grad();
    let loss = model
        .forward(&mut acts, &inputs, Some(&targets))
        .unwrap()
        .unwrap();
    model.backward(&mut acts).unwrap();
    Step {
        loss,
        logits: acts.logits().to_vec(),
        grads: model.grads.clone(),
    }
}

/// `got` within 1e-5 of `want`'s largest magnitude.
fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= 1e-5 * scale, "{what}: off by {worst} of {scale}");
}

#[test]
fn moe_gpt_with_ep_2_and_4_matches_ep_1() {
    let full = full_model();
    for ep in [2usize, 4] {
        // Reference: the unsharded model on each rank's tokens.
        let mut reference = full_model();
        let refs: Vec<Step> = (0..ep).map(|r| step(&mut reference, r)).collect();
        let mut expert_sum = vec![0.0f32; reference.grads.len()];
        for s in &refs {
            for (a, b) in expert_sum.iter_mut().zip(&s.grads) {
                *a += b;
            }
        }
        let results = LocalCluster::run(ep, |comm| {
            let rank = comm.rank();
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let (ffn, stats) = MoeFfn::with_expert_parallel(moe_config(), comm).unwrap();
            assert_eq!((ffn.ep_size(), ffn.ep_rank()), (ep, rank));
            assert_eq!(ffn.local_experts(), 8 / ep);
            let mut local = Gpt::with_ffn(gpt_config(), Box::new(ffn)).unwrap();
            local.load_part(&full).unwrap();
            let s = step(&mut local, rank);
            let load = stats.take();
            (s, local, load)
        })
        .unwrap();
        for (rank, (s, local, load)) in results.iter().enumerate() {
            let want = &refs[rank];
            assert!(
                (s.loss - want.loss).abs() <= 1e-6 * want.loss.abs(),
                "ep={ep} rank {rank} loss {} vs {}",
                s.loss,
                want.loss
            );
            close(
                &s.logits,
                &want.logits,
                &format!("ep={ep} rank {rank} logits"),
            );
            // One forward per layer, each over this rank's B·T tokens.
            assert_eq!(load.len(), 2);
            assert!(load.iter().all(|(_, f)| f.stats.tokens == (B * T) as u64));
            for spec in local.layout().specs() {
                let name = &spec.name;
                let got = &s.grads[spec.range()];
                let src = reference.layout().get(name).unwrap().range();
                if MoeFfn::is_expert_param(name) {
                    let per = got.len();
                    let all = &expert_sum[src];
                    let want = &all[rank * per..(rank + 1) * per];
                    assert!(want.iter().any(|&g| g != 0.0), "{name}: no gradient");
                    close(got, want, &format!("ep={ep} rank {rank} {name}"));
                } else {
                    close(
                        got,
                        &want.grads[src],
                        &format!("ep={ep} rank {rank} {name}"),
                    );
                }
            }
        }
    }
}

#[test]
fn sharding_checks_the_group_size_and_the_whole_model() {
    let full = full_model();
    let err = LocalCluster::run(3, |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        MoeFfn::with_expert_parallel(moe_config(), comm)
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    assert!(
        err[0].contains("parallel.ep") && err[0].contains('8'),
        "{}",
        err[0]
    );
    // Rank 1 of 2 takes the second half of the experts.
    let mut two = LocalCluster::run(2, |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let (ffn, _) = MoeFfn::with_expert_parallel(moe_config(), comm).unwrap();
        Gpt::with_ffn(gpt_config(), Box::new(ffn)).unwrap()
    })
    .unwrap();
    let [_, one] = &mut two[..] else {
        unreachable!()
    };
    one.load_part(&full).unwrap();
    // A whole model without a mixture of experts is an error naming the
    // first tensor it lacks.
    let dense = Gpt::new(gpt_config()).unwrap();
    let e = one.load_part(&dense).unwrap_err().to_string();
    assert!(
        e.contains("transformer.h.0.mlp.router.weight") && e.contains("not in"),
        "{e}"
    );
    let name = "transformer.h.0.mlp.experts.c_proj.bias";
    let (a, b) = (one.param(name).unwrap(), full.param(name).unwrap());
    assert_eq!(a, &b[b.len() / 2..]);
}
