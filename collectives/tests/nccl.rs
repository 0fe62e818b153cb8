//! The NCCL backend (feature `nccl`) on one GPU against a CPU reference.
//!
//! NCCL refuses two ranks on one GPU, so this runs world size 1 on GPU 0:
//! every collective goes through NCCL on the device (host buffers staged
//! through the GPU, and the `*_device` methods on device buffers) and must
//! equal the serial reference bit for bit. Without the CUDA driver, NCCL or
//! a GPU it checks that the backend reports a typed "not available" error
//! (instead of cudarc's panic) and prints `SKIPPED:` (the test command
//! counts a skip: this binary has no libtest harness, so it prints the
//! harness's `test result` line itself) — unless
//! `WEFT_REQUIRE_GPU=1`, which makes a missing GPU a failure (the GPU
//! machine's `collectives/gpu-check.sh` sets it).
#![allow(clippy::print_stdout, clippy::print_stderr)]

use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, Element, Error, Incoming, NcclComm, OpKind, Outgoing,
    ReduceOp, ReduceOptions, Signature, bf16, f16, nccl_available,
};

fn main() {
    let required = std::env::var("WEFT_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let devices = match nccl_available() {
        Ok(n) => n,
        Err(e) => {
            assert!(
                matches!(
                    e,
                    Error::BackendUnavailable {
                        backend: "nccl",
                        ..
                    }
                ),
                "expected a typed unavailability error, got {e:?}"
            );
            let c = NcclComm::single(0).expect_err("no NCCL, no communicator");
            assert!(matches!(c, Error::BackendUnavailable { .. }), "{c:?}");
            if required {
                eprintln!("FAIL nccl GPU check: {e}");
                std::process::exit(1);
            }
            println!("SKIPPED: nccl GPU check: {e}");
            println!("test result: ok. 1 passed; 0 failed; 0 ignored");
            return;
        }
    };
    println!("nccl GPU check: {devices} GPU(s) visible; using GPU 0, world size 1");
    let comm = NcclComm::single(0).expect("NCCL communicator on GPU 0");
    assert_eq!((comm.rank(), comm.size()), (0, 1));
    let mut checks = 0;
    for len in [0usize, 1, 7, 1000, (1 << 20) + 3] {
        checks += host_ops::<f32>(&comm, len);
        checks += host_ops::<f64>(&comm, len);
        checks += host_ops::<f16>(&comm, len);
        checks += host_ops::<bf16>(&comm, len);
    }
    checks += device_ops(&comm);
    checks += self_exchange(&comm);
    checks += errors(&comm);
    println!("nccl GPU check: {checks} checks passed");
    println!("test result: ok. 1 passed; 0 failed; 0 ignored");
}

/// Values with a wide exponent spread and both signs (and a NaN-free,
/// exactly representable set for every dtype: small integers / 8).
fn data<T: Element>(len: usize, seed: u64) -> Vec<T> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f64(((s >> 40) % 2001) as f64 / 8.0 - 125.0)
        })
        .collect()
}

fn bits<T: Element>(xs: &[T]) -> Vec<u64> {
    xs.iter().map(|x| x.to_f64().to_bits()).collect()
}

/// Every host-buffer collective with one rank: the reduction of one
/// contribution is itself (the average divides by 1), the gather of one
/// shard is the shard, the broadcast from rank 0 is the buffer.
fn host_ops<T: Element>(c: &NcclComm, len: usize) -> usize {
    let x: Vec<T> = data(len, len as u64 + 17);
    let what = |op: &str| format!("{op} {} x {len}", T::DTYPE);
    let mut k = 0;
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
        let mut b = x.clone();
        c.all_reduce(&mut b, op)
            .unwrap_or_else(|e| panic!("{}: {e}", what("all_reduce")));
        assert_eq!(bits(&b), bits(&x), "{} {op:?}", what("all_reduce"));
        let mut out = vec![T::ZERO; len];
        c.reduce_scatter(&x, &mut out, op)
            .unwrap_or_else(|e| panic!("{}: {e}", what("reduce_scatter")));
        assert_eq!(bits(&out), bits(&x), "{} {op:?}", what("reduce_scatter"));
        let mut b = x.clone();
        c.reduce(&mut b, 0, op)
            .unwrap_or_else(|e| panic!("{}: {e}", what("reduce")));
        assert_eq!(bits(&b), bits(&x), "{} {op:?}", what("reduce"));
        k += 3;
    }
    let mut out = vec![T::ZERO; len];
    c.all_gather(&x, &mut out)
        .unwrap_or_else(|e| panic!("{}: {e}", what("all_gather")));
    assert_eq!(bits(&out), bits(&x), "{}", what("all_gather"));
    let mut b = x.clone();
    c.broadcast(&mut b, 0)
        .unwrap_or_else(|e| panic!("{}: {e}", what("broadcast")));
    assert_eq!(bits(&b), bits(&x), "{}", what("broadcast"));
    // non-native paths: reproducible mode and a wider wire dtype run this
    // crate's algorithms over the backend's exchange
    let mut b = x.clone();
    c.all_reduce_with(
        &mut b,
        &ReduceOptions::new(ReduceOp::Sum)
            .algorithm(Algorithm::Ring)
            .reproducible(true),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", what("reproducible all_reduce")));
    assert_eq!(bits(&b), bits(&x), "{}", what("reproducible all_reduce"));
    k + 3
}

/// The device-buffer methods against the same CPU reference.
fn device_ops(c: &NcclComm) -> usize {
    let s = c.stream();
    let x: Vec<f32> = data(1 << 20, 5);
    let mut d = s.clone_htod(&x).expect("upload");
    c.all_reduce_device(&mut d, ReduceOp::Sum)
        .expect("all_reduce_device");
    assert_eq!(s.clone_dtoh(&d).expect("download"), x, "all_reduce_device");
    let mut out = s.alloc_zeros::<f32>(x.len()).expect("alloc");
    c.all_gather_device(&d, &mut out)
        .expect("all_gather_device");
    assert_eq!(
        s.clone_dtoh(&out).expect("download"),
        x,
        "all_gather_device"
    );
    let mut rs = s.alloc_zeros::<f32>(x.len()).expect("alloc");
    c.reduce_scatter_device(&d, &mut rs, ReduceOp::Max)
        .expect("reduce_scatter_device");
    assert_eq!(
        s.clone_dtoh(&rs).expect("download"),
        x,
        "reduce_scatter_device"
    );
    c.broadcast_device(&mut d, 0).expect("broadcast_device");
    assert_eq!(s.clone_dtoh(&d).expect("download"), x, "broadcast_device");
    // a large all-reduce, timed (world size 1: a device-local copy)
    let big: Vec<f32> = data(64 << 18, 9); // 64 MiB
    let mut d = s.clone_htod(&big).expect("upload");
    let t0 = std::time::Instant::now();
    for _ in 0..10 {
        c.all_reduce_device(&mut d, ReduceOp::Sum)
            .expect("all_reduce_device 64 MiB");
    }
    println!(
        "nccl GPU check: all_reduce_device 64 MiB, world 1: {:.1} us per call",
        t0.elapsed().as_secs_f64() * 1e5
    );
    assert_eq!(s.clone_dtoh(&d).expect("download"), big);
    5
}

/// The transport primitive over grouped ncclSend/ncclRecv, to this rank
/// itself (NCCL allows self-sends inside a group, as all-to-all uses them).
fn self_exchange(c: &NcclComm) -> usize {
    let data: Vec<u8> = (0..100_003u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut got = Vec::new();
    let ctx = c.begin(Signature::new(OpKind::SendRecv)).expect("begin");
    let mut sink = |b: &[u8]| {
        got.extend_from_slice(b);
        Ok(())
    };
    c.exchange(
        &ctx,
        0,
        &[Outgoing { to: 0, data: &data }],
        &mut [Incoming {
            from: 0,
            len: Some(data.len()),
            sink: &mut sink,
        }],
    )
    .expect("exchange with itself");
    assert_eq!(got, data, "self exchange");
    1
}

fn errors(c: &NcclComm) -> usize {
    let e = c.broadcast(&mut [1f32; 4], 1).expect_err("root 1 of 1");
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let Err(e) = c.split(0, 0) else {
        panic!("split is refused")
    };
    assert!(e.to_string().contains("NcclComm::over"), "{e}");
    let s = c.stream();
    let d = s.alloc_zeros::<f32>(8).expect("alloc");
    let mut wrong = s.alloc_zeros::<f32>(9).expect("alloc");
    let e = c
        .all_gather_device(&d, &mut wrong)
        .expect_err("wrong output length");
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    3
}
