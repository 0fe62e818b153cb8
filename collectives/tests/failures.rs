//! Peer loss, timeouts and mismatched calls: errors, never hangs.

use std::time::{Duration, Instant};

use weft_collectives::{
    Communicator, CommunicatorExt, Error, LocalCluster, LossCause, OpKind, ReduceOp,
};

const SHORT: Duration = Duration::from_millis(1500);

#[test]
fn a_panicking_rank_is_reported_by_its_peers() {
    let start = Instant::now();
    let out = LocalCluster::builder(4)
        .timeout(Duration::from_secs(30))
        .run_each(|comm| {
            if comm.rank() == 2 {
                panic!("boom");
            }
            let mut x = vec![1.0f32; 1000];
            comm.all_reduce(&mut x, ReduceOp::Sum)
        });
    // detected through the loss, not by the 30 s timeout (half of it is
    // far more than a loaded machine needs to notice a panicked thread)
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
    assert!(matches!(&out[2], Err(Error::RankPanicked { rank: 2, .. })));
    let mut saw_loss = false;
    for r in [0, 1, 3] {
        match &out[r] {
            Ok(Err(Error::PeerLost {
                rank: 2,
                op: OpKind::AllReduce,
                cause: LossCause::Panicked,
                ..
            })) => saw_loss = true,
            Ok(Err(Error::PeerLost {
                op: OpKind::AllReduce,
                ..
            })) => {}
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(saw_loss);
}

#[test]
fn a_rank_that_returns_early_is_lost_not_waited_for() {
    let out = LocalCluster::builder(3)
        .timeout(Duration::from_secs(30))
        .run_each(|comm| {
            if comm.rank() == 0 {
                return Ok(());
            }
            comm.barrier()
        });
    for r in [1, 2] {
        let e = out[r].as_ref().unwrap().as_ref().unwrap_err();
        assert!(
            matches!(
                e,
                Error::PeerLost {
                    op: OpKind::Barrier,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("lost"), "{e}");
    }
}

#[test]
fn fault_injection_fails_the_rank_and_its_peers_see_it() {
    let out = LocalCluster::builder(4)
        .timeout(Duration::from_secs(30))
        .fail_rank_at(1, 2)
        .run_each(|comm| {
            let mut results = Vec::new();
            for _ in 0..4 {
                let mut x = vec![1.0f64; 64];
                results.push(comm.all_reduce(&mut x, ReduceOp::Sum).map(|()| x[0]));
            }
            results
        });
    let r1 = out[1].as_ref().unwrap();
    assert_eq!(r1[0].as_ref().unwrap(), &4.0);
    assert!(matches!(
        r1[2],
        Err(Error::InjectedFault {
            rank: 1,
            op: OpKind::AllReduce
        })
    ));
    assert!(matches!(r1[3], Err(Error::InjectedFault { .. })));
    let mut named = 0;
    for r in [0, 2, 3] {
        let rr = out[r].as_ref().unwrap();
        assert_eq!(rr[1].as_ref().unwrap(), &4.0);
        // every later call fails; the neighbours of rank 1 name it, the
        // others may instead see a neighbour that already gave up and left
        assert!(
            rr[2..]
                .iter()
                .all(|x| matches!(x, Err(Error::PeerLost { .. }))),
            "rank {r}: {rr:?}"
        );
        if matches!(
            rr[2],
            Err(Error::PeerLost {
                rank: 1,
                cause: LossCause::Injected,
                ..
            })
        ) {
            named += 1;
        }
    }
    assert!(named >= 1);
}

#[test]
fn the_watchdog_names_ranks_that_did_not_arrive() {
    let start = Instant::now();
    let out = LocalCluster::builder(4)
        .timeout(Duration::from_millis(300))
        .run_each(|comm| {
            if comm.rank() == 3 {
                std::thread::sleep(Duration::from_millis(1200));
                return Ok(());
            }
            let mut x = vec![1.0f32; 100];
            comm.all_reduce(&mut x, ReduceOp::Sum)
        });
    assert!(start.elapsed() < Duration::from_secs(5));
    let mut named = false;
    for (r, res) in out.iter().enumerate().take(3) {
        match res.as_ref().unwrap() {
            Err(Error::Timeout {
                op: OpKind::AllReduce,
                missing,
                ..
            }) => {
                assert_eq!(missing, &vec![3], "rank {r}");
                named = true;
            }
            // a neighbour of a timed-out rank may see it leave first
            Err(Error::PeerLost { .. }) => {}
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(named);
    let e = Error::Timeout {
        op: OpKind::AllReduce,
        group: "world[0, 1]".into(),
        rank: 0,
        missing: vec![1],
        waiting_for: vec![1],
        after: SHORT,
    };
    assert!(e.to_string().contains("ranks [1] did not arrive"));
}

#[test]
fn mismatched_lengths_and_ops_are_errors_on_every_rank() {
    let start = Instant::now();
    let out = LocalCluster::builder(4).timeout(SHORT).run_each(|comm| {
        let len = if comm.rank() == 2 { 12 } else { 10 };
        let mut x = vec![1.0f32; len];
        comm.all_reduce(&mut x, ReduceOp::Sum)
    });
    assert!(start.elapsed() < Duration::from_secs(6));
    let mut mismatch = 0;
    for r in out {
        match r.unwrap() {
            Err(Error::Mismatch { ours, theirs, .. }) => {
                assert!(ours.contains("x 10") || theirs.contains("x 10"));
                mismatch += 1;
            }
            Err(Error::Aborted { .. } | Error::PeerLost { .. } | Error::Timeout { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    assert!(mismatch >= 1);

    let out = LocalCluster::builder(2).timeout(SHORT).run_each(|comm| {
        if comm.rank() == 0 {
            comm.barrier()
        } else {
            let mut x = vec![1.0f32; 4];
            comm.all_reduce(&mut x, ReduceOp::Sum)
        }
    });
    for r in out {
        let e = r.unwrap().unwrap_err();
        assert!(
            matches!(
                e,
                Error::Mismatch { .. } | Error::Aborted { .. } | Error::PeerLost { .. }
            ),
            "{e}"
        );
    }

    // dtype mismatch
    let out = LocalCluster::builder(2).timeout(SHORT).run_each(|comm| {
        if comm.rank() == 0 {
            let mut x = vec![1.0f32; 4];
            comm.all_reduce(&mut x, ReduceOp::Sum)
        } else {
            let mut x = vec![1.0f64; 4];
            comm.all_reduce(&mut x, ReduceOp::Sum)
        }
    });
    assert!(
        out.iter()
            .any(|r| matches!(r, Ok(Err(Error::Mismatch { .. }))))
    );
}

#[test]
fn all_to_all_v_count_mismatch_is_reported() {
    let out = LocalCluster::builder(2).timeout(SHORT).run_each(|comm| {
        let r = comm.rank();
        // rank 0 sends 3 to rank 1, but rank 1 expects 2
        let send_counts = [1usize, if r == 0 { 3 } else { 1 }];
        let recv_counts = if r == 0 { [1usize, 1] } else { [2, 1] };
        let send = vec![1.0f32; send_counts.iter().sum()];
        let mut recv = vec![0f32; recv_counts.iter().sum()];
        let _ = (send_counts, recv_counts);
        comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
    });
    let e = out[1].as_ref().unwrap().as_ref().unwrap_err();
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");
    // bad arguments are caught before any message
    let out = LocalCluster::run(2, |comm| {
        let mut recv = vec![0f32; 2];
        comm.all_to_all_v(&[1.0f32; 3], &[1, 1], &mut recv, &[1, 1])
    })
    .unwrap();
    assert!(
        out[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("sum to 2")
    );
}

#[test]
fn invalid_arguments_name_what_was_wrong() {
    let out = LocalCluster::run(3, |comm| -> Vec<String> {
        let mut v = Vec::new();
        let mut x = vec![0f32; 4];
        v.push(comm.broadcast(&mut x, 5).unwrap_err().to_string());
        let mut out = vec![0f32; 3];
        v.push(
            comm.reduce_scatter(&[1.0f32; 10], &mut out, ReduceOp::Sum)
                .unwrap_err()
                .to_string(),
        );
        v.push(comm.send(9, 0, &[1.0f32]).unwrap_err().to_string());
        v
    })
    .unwrap();
    let v = &out[0];
    assert!(
        v[0].contains("root 5 is outside the group of 3"),
        "{}",
        v[0]
    );
    assert!(v[1].contains("expected 4"), "{}", v[1]);
    assert!(v[2].contains("peer"), "{}", v[2]);
    let _ = SHORT;
}

#[test]
fn a_receiver_that_dies_does_not_strand_the_sender() {
    let out = LocalCluster::builder(2)
        .timeout(Duration::from_secs(30))
        .run_each(|comm| {
            if comm.rank() == 1 {
                comm.inject_failure();
                return Ok(());
            }
            let mut x = vec![1.0f32; 1 << 14];
            comm.broadcast(&mut x, 0)
        });
    assert!(
        matches!(out[0], Ok(Err(Error::PeerLost { rank: 1, .. }))),
        "{:?}",
        out[0]
    );
    let _ = |c: &dyn Communicator| c.rank();
}

#[test]
fn a_failed_rank_ends_the_nested_reproducible_reductions_of_its_peers() {
    // The reproducible all-reduce of 4 ranks in one domain holds every
    // incoming chunk through nested exchanges: a rank that fails makes each peer's call fail too, at
    // once (a peer whose message was withdrawn by a failing rank is
    // released by the group abort, not by its 20 s timeout).
    let start = Instant::now();
    let out = LocalCluster::builder(4)
        .timeout(Duration::from_secs(20))
        .fail_rank_at(2, 1)
        .run_each(|comm| {
            let opts = weft_collectives::ReduceOptions::new(ReduceOp::Sum).reproducible(true);
            let mut results = Vec::new();
            for _ in 0..3 {
                let mut x: Vec<f32> = (0..1000).map(|i| (i as f32).sin()).collect();
                results.push(comm.all_reduce_with(&mut x, &opts).map(|()| x[7]));
                let mut y: Vec<f32> = (0..1000).map(|i| (i as f32).cos()).collect();
                results.push(comm.all_reduce_with(&mut y, &opts).map(|()| y[7]));
            }
            results
        });
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
    for (r, rr) in out.iter().enumerate() {
        let rr = rr.as_ref().unwrap();
        // the first reproducible all-reduce completes everywhere
        assert!(rr[0].is_ok(), "rank {r}: {rr:?}");
        assert!(rr[2..].iter().all(Result::is_err), "rank {r}: {rr:?}");
    }
}
