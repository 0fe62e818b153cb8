//! Traffic counters against textbook volumes.

use weft_collectives::{
    Algorithm, Communicator, CommunicatorExt, LinkClass, LocalCluster, OpKind, ReduceOp,
    ReduceOptions, Topology,
};

fn run_counted<F>(n: usize, topo: Topology, f: F) -> Vec<weft_collectives::Traffic>
where
    F: Fn(&weft_collectives::LocalComm) -> weft_collectives::Result<()> + Sync,
{
    LocalCluster::builder(n)
        .topology(topo)
        .run_each(|comm| {
            f(&comm)?;
            Ok::<_, weft_collectives::Error>(comm.traffic())
        })
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect()
}

#[test]
fn ring_volumes_are_textbook() {
    for n in [2usize, 3, 4, 8] {
        let elems = 1024 * n; // divisible: every chunk the same size
        let s = (elems * 4) as u64;
        let per_rank = run_counted(n, Topology::flat(), |comm| {
            let mut x = vec![1.0f32; elems];
            let ring = ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring);
            comm.all_reduce_with(&mut x, &ring)?;
            let mut out = vec![0f32; elems / n];
            comm.reduce_scatter_with(&x, &mut out, &ring)?;
            let mut full = vec![0f32; elems];
            comm.all_gather_with(&out, &mut full, Algorithm::Ring)?;
            Ok(())
        });
        let n64 = n as u64;
        for t in &per_rank {
            assert_eq!(
                t.sent_by(OpKind::AllReduce),
                2 * (n64 - 1) * s / n64,
                "n={n}"
            );
            assert_eq!(t.received_by(OpKind::AllReduce), 2 * (n64 - 1) * s / n64);
            assert_eq!(t.sent_by(OpKind::ReduceScatter), (n64 - 1) * s / n64);
            assert_eq!(t.sent_by(OpKind::AllGather), (n64 - 1) * s / n64);
            assert_eq!(t.sent_over(LinkClass::Inter), 0);
        }
    }
}

#[test]
fn hierarchical_all_reduce_keeps_inter_domain_links_light() {
    // k = 4 ranks per domain, d = 2 domains.
    let (k, d) = (4usize, 2usize);
    let n = k * d;
    let elems = 4096 * n;
    let s = (elems * 4) as u64;
    let per_rank = run_counted(n, Topology::new(k), |comm| {
        let mut x = vec![1.0f32; elems];
        comm.all_reduce_with(
            &mut x,
            &ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Hierarchical),
        )?;
        assert!(x.iter().all(|&v| v == n as f32));
        Ok(())
    });
    let ring = run_counted(n, Topology::new(k), |comm| {
        let mut x = vec![1.0f32; elems];
        comm.all_reduce_with(
            &mut x,
            &ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring),
        )?;
        Ok(())
    });
    let (k64, d64) = (k as u64, d as u64);
    for (t, tr) in per_rank.iter().zip(&ring) {
        // textbook: 2(d−1)/d · S/k over inter-domain links
        assert_eq!(
            t.sent(OpKind::AllReduce, LinkClass::Inter),
            2 * (d64 - 1) * s / d64 / k64
        );
        // and 2(k−1)/k · S inside the domain
        assert_eq!(
            t.sent(OpKind::AllReduce, LinkClass::Intra),
            2 * (k64 - 1) * s / k64
        );
        // the flat ring sends more than that over inter-domain links on the
        // two ranks at the domain boundary
        let _ = tr;
    }
    let ring_inter: u64 = ring.iter().map(|t| t.sent_over(LinkClass::Inter)).sum();
    let hier_inter: u64 = per_rank.iter().map(|t| t.sent_over(LinkClass::Inter)).sum();
    assert!(
        hier_inter < ring_inter,
        "hierarchical {hier_inter} vs ring {ring_inter}"
    );
}

#[test]
fn auto_policy_picks_by_size_and_topology() {
    assert_eq!(
        Algorithm::Auto.resolve(1024, true),
        Algorithm::RecursiveDoubling
    );
    assert_eq!(
        Algorithm::Auto.resolve(1 << 20, true),
        Algorithm::Hierarchical
    );
    assert_eq!(Algorithm::Auto.resolve(1 << 20, false), Algorithm::Ring);
    // recursive doubling of S bytes over 8 ranks: log2(8) · S per rank
    let s = 256 * 4u64;
    let t = run_counted(8, Topology::flat(), |comm| {
        let mut x = vec![1.0f32; 256];
        comm.all_reduce(&mut x, ReduceOp::Sum)
    });
    assert!(t.iter().all(|t| t.sent_by(OpKind::AllReduce) == 3 * s));
}

#[test]
fn reproducible_ring_in_one_domain_sends_the_ring_volume() {
    // The direct reduce-scatter of the reproducible mode (3 to 16 ranks in
    // one domain) sends each rank's (n−1)/n of the buffer once, as native
    // values: the ring's bytes, so all-reduce stays at 2(n−1)/n·S.
    for n in [3usize, 4, 8] {
        let elems = 1024 * n;
        let s = (elems * 4) as u64;
        let per_rank = run_counted(n, Topology::flat(), |comm| {
            let mut x: Vec<f32> = (0..elems).map(|i| (i as f32).sin()).collect();
            let opts = ReduceOptions::new(ReduceOp::Sum)
                .algorithm(Algorithm::Ring)
                .reproducible(true);
            let mut out = vec![0f32; elems / n];
            comm.reduce_scatter_with(&x, &mut out, &opts)?;
            comm.all_reduce_with(&mut x, &opts)?;
            Ok(())
        });
        let n64 = n as u64;
        for t in &per_rank {
            assert_eq!(
                t.sent_by(OpKind::ReduceScatter),
                (n64 - 1) * s / n64,
                "n={n}"
            );
            assert_eq!(
                t.sent_by(OpKind::AllReduce),
                2 * (n64 - 1) * s / n64,
                "n={n}"
            );
            assert_eq!(t.received_by(OpKind::AllReduce), 2 * (n64 - 1) * s / n64);
        }
    }
}

#[test]
fn each_group_counts_its_own_traffic() {
    // 4 ranks as a 2×2 mesh: rows all-reduce 8 KiB, columns 4 KiB; each
    // group's counters see only their own ring, the world's see both.
    let (row, col) = (2048usize, 1024usize);
    let ring = ReduceOptions::new(ReduceOp::Sum).algorithm(Algorithm::Ring);
    let out = LocalCluster::builder(4)
        .run_each(|comm| {
            let r = comm.rank() as u32;
            let rows = comm.split(r / 2, r)?;
            let cols = comm.split(r % 2, r)?;
            let mut a = vec![1.0f32; row];
            rows.all_reduce_with(&mut a, &ring)?;
            let mut b = vec![1.0f32; col];
            cols.all_reduce_with(&mut b, &ring)?;
            let det = cols.detach().expect("local handles detach");
            det.all_reduce_with(&mut b, &ring)?;
            Ok::<_, weft_collectives::Error>((
                rows.group_traffic(),
                cols.group_traffic(),
                comm.group_traffic(),
                comm.traffic(),
            ))
        })
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect::<Vec<_>>();
    for (rows, cols, world_group, all) in &out {
        // A ring all-reduce over 2 ranks sends half the buffer once… twice.
        assert_eq!(rows.sent_by(OpKind::AllReduce), 4 * row as u64);
        assert_eq!(cols.sent_by(OpKind::AllReduce), 2 * 4 * col as u64);
        assert_eq!(rows.received_by(OpKind::AllReduce), 4 * row as u64);
        // The world group itself only ran the two splits.
        assert_eq!(world_group.sent_by(OpKind::AllReduce), 0);
        assert!(world_group.sent_by(OpKind::Split) > 0);
        assert_eq!(
            all.sent_by(OpKind::AllReduce),
            rows.sent_by(OpKind::AllReduce) + cols.sent_by(OpKind::AllReduce)
        );
        assert_eq!(
            all.total_sent(),
            rows.total_sent() + cols.total_sent() + world_group.total_sent()
        );
    }
}
