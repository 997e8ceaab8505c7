//! Hierarchical allgather across "hosts" (loopback addresses): the same rows in the same
//! order as the flat path, whatever the ranks' placement and row counts; a bad call fails on
//! every rank and leaves the communicator usable.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use support::world_on;

/// Every rank's allgathers of rows of 3 (rank `r` gives `r % 3` rows, then a large 40 000
/// rows) and whether they ran hierarchically, on a world over `ips`.
fn gathers(ips: &[&str], hierarchical: Option<bool>) -> Vec<(Vec<i64>, Vec<f32>, bool)> {
    world_on(
        ips,
        |cfg| cfg.hierarchical_allgather = hierarchical,
        |comm| {
            let r = comm.rank() as i64;
            let small: Vec<i64> = (0..3 * (r % 3)).map(|i| 100 * r + i).collect();
            let a = comm.allgather(&small, 3).unwrap();
            let big: Vec<f32> = (0..3 * 40_000).map(|i| (r * 7 + i % 11) as f32).collect();
            let b = comm.allgather(&big, 3).unwrap();
            (a, b, comm.is_hierarchical_allgather())
        },
    )
}

fn expected(n: usize) -> (Vec<i64>, Vec<f32>) {
    let mut a = Vec::new();
    let mut b = Vec::new();
    for r in 0..n as i64 {
        a.extend((0..3 * (r % 3)).map(|i| 100 * r + i));
        b.extend((0..3 * 40_000).map(|i| (r * 7 + i % 11) as f32));
    }
    (a, b)
}

#[test]
fn two_hosts_and_three_interleaved_hosts_gather_in_rank_order() {
    for ips in [
        &["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"][..],
        &[
            "127.0.0.2",
            "127.0.0.3",
            "127.0.0.4",
            "127.0.0.4",
            "127.0.0.3",
            "127.0.0.2",
        ][..],
    ] {
        let (a, b) = expected(ips.len());
        for (r, (ga, gb, hier)) in gathers(ips, Some(true)).into_iter().enumerate() {
            assert!(
                hier,
                "{ips:?}: rank {r} gathers hierarchically where asked and it applies"
            );
            assert_eq!(ga, a, "{ips:?}: rank {r}");
            assert!(gb == b, "{ips:?}: rank {r}: large rows differ");
        }
        for (r, (ga, gb, hier)) in gathers(ips, None).into_iter().enumerate() {
            assert!(
                !hier,
                "{ips:?}: rank {r}: flat unless asked for (Horovod's default)"
            );
            assert_eq!(ga, a, "{ips:?}: rank {r}");
            assert!(gb == b, "{ips:?}: rank {r}: large rows differ");
        }
        for (r, (ga, gb, hier)) in gathers(ips, Some(false)).into_iter().enumerate() {
            assert!(!hier, "{ips:?}: rank {r}: 0 forbids it");
            assert_eq!(ga, a, "{ips:?}: rank {r}");
            assert!(gb == b, "{ips:?}: rank {r}: large rows differ");
        }
    }
}

#[test]
fn asking_where_it_cannot_apply_gathers_flat() {
    // One host: no hierarchy, and asking for it is only logged.
    for (r, (ga, gb, hier)) in gathers(&["127.0.0.1"; 3], Some(true))
        .into_iter()
        .enumerate()
    {
        let (a, b) = expected(3);
        assert!(!hier, "rank {r}");
        assert_eq!(ga, a);
        assert!(gb == b);
    }
}

#[test]
fn bad_calls_fail_on_every_rank_and_the_communicator_survives() {
    let ips = ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"];
    let out = world_on(
        &ips,
        |cfg| cfg.hierarchical_allgather = Some(true),
        |comm| {
            let r = comm.rank();
            // Rank 3 passes rows of 2 where the others pass rows of 3.
            let row = if r == 3 { 2 } else { 3 };
            let mismatch = comm.allgather(&[1i32; 6], row).unwrap_err().to_string();
            // Rank 1's contribution is not whole rows.
            let n = if r == 1 { 4 } else { 3 };
            let ragged = comm.allgather(&vec![1i32; n], 3).unwrap_err().to_string();
            let after = comm.allgather(&[r as f64], 1).unwrap();
            (mismatch, ragged, after, comm.is_hierarchical_allgather())
        },
    );
    for (r, (mismatch, ragged, after, hier)) in out.into_iter().enumerate() {
        assert!(hier);
        assert!(
            mismatch.contains("rank 3") && mismatch.contains("rows of 2"),
            "rank {r}: {mismatch}"
        );
        assert!(
            ragged.contains("rank 1") || ragged.contains("whole rows"),
            "rank {r}: {ragged}"
        );
        assert_eq!(after, vec![0.0, 1.0, 2.0, 3.0], "rank {r}");
    }
}

#[test]
fn one_rank_refusing_makes_allgather_flat_everywhere_and_leaves_allreduce_alone() {
    let ips = ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"];
    let out = world_on(
        &ips,
        |cfg| {
            cfg.hierarchical_allgather = Some(cfg.rank != 2);
        },
        |comm| {
            let got = comm.allgather(&[comm.rank() as i32; 2], 2).unwrap();
            (
                got,
                comm.is_hierarchical_allgather(),
                comm.is_hierarchical(),
            )
        },
    );
    for (r, (got, gather, reduce)) in out.into_iter().enumerate() {
        assert_eq!(got, vec![0, 0, 1, 1, 2, 2, 3, 3], "rank {r}");
        assert!(
            !gather && reduce,
            "rank {r}: allgather flat, allreduce hierarchical"
        );
    }
}
