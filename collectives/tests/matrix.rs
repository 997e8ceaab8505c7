//! Every collective × dtype × op against references computed here, for worlds of 1, 2, 3, 4
//! and 7 ranks, with lengths that are empty, tiny, not divisible by the world size, on the
//! latency path and on the ring path.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test that cannot set up fails loudly

mod support;

use hvd_collectives::{CommConfig, Communicator, ReduceOp, bf16, f16};
use support::{TestElem, assert_close, reduced, world, world_on, world_with};

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Average,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Product,
];
/// Empty, one, not divisible by 2/3/4/7, latency path (≤ 32 KiB), ring path, several segments.
const LENS: [usize; 6] = [0, 1, 13, 1001, 20_011, 150_001];

/// Small integers, so that sums and products are exact in every type and any reduction order.
fn value(rank: usize, i: usize, op: ReduceOp, salt: usize) -> f64 {
    let h = (rank * 7 + i * 3 + salt * 11) % 5;
    if op == ReduceOp::Product {
        (h % 2 + 1) as f64
    } else {
        (h + 1) as f64
    }
}

fn input<T: TestElem>(rank: usize, len: usize, op: ReduceOp, salt: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f64(value(rank, i, op, salt)))
        .collect()
}

fn reference<T: TestElem>(n: usize, len: usize, op: ReduceOp, salt: usize) -> Vec<T> {
    (0..len)
        .map(|i| reduced::<T>((0..n).map(|r| value(r, i, op, salt)), n, op))
        .collect()
}

fn check_dtype<T: TestElem>(comm: &mut Communicator) {
    let (n, r) = (comm.size(), comm.rank());
    let name = T::DTYPE.name();
    for (salt, &len) in LENS.iter().enumerate() {
        for op in OPS {
            let what = format!("{name} n={n} rank={r} len={len} {op}");
            let mut buf = input::<T>(r, len, op, salt);
            comm.allreduce(&mut buf, op).expect("allreduce");
            assert_close(
                &buf,
                &reference::<T>(n, len, op, salt),
                &format!("allreduce {what}"),
            );

            let full = reference::<T>(n, len, op, salt);
            let got = comm
                .reducescatter(&input::<T>(r, len, op, salt), op)
                .expect("reducescatter");
            let (base, extra) = (len / n, len % n);
            let start = r * base + r.min(extra);
            let mine = &full[start..start + base + usize::from(r < extra)];
            assert_close(&got, mine, &format!("reducescatter {what}"));
        }
        // Grouped: three tensors of different lengths, reduced as one.
        for gop in [ReduceOp::Sum, ReduceOp::Average] {
            let mut a = input::<T>(r, len, gop, salt);
            let mut b = input::<T>(r, len / 2 + 1, gop, salt + 1);
            let mut c = input::<T>(r, 3, gop, salt + 2);
            comm.grouped_allreduce(&mut [&mut a, &mut b, &mut c], gop)
                .expect("grouped");
            let what = format!("grouped {gop:?}");
            assert_close(&a, &reference::<T>(n, len, gop, salt), &format!("{what} a"));
            assert_close(
                &b,
                &reference::<T>(n, len / 2 + 1, gop, salt + 1),
                &format!("{what} b"),
            );
            assert_close(
                &c,
                &reference::<T>(n, 3, gop, salt + 2),
                &format!("{what} c"),
            );
        }

        for root in 0..n {
            let mut buf = if r == root {
                input::<T>(root, len, ReduceOp::Sum, salt)
            } else {
                vec![T::from_f64(0.0); len]
            };
            comm.broadcast(&mut buf, root).expect("broadcast");
            assert_close(
                &buf,
                &input::<T>(root, len, ReduceOp::Sum, salt),
                &format!("broadcast root {root} {name} len {len}"),
            );
        }

        // Allgather: rows of 3, a different number of rows on every rank.
        let rows = |rank: usize| (len / 3 + rank * 5) % (len / 3 + 2);
        let gathered = comm
            .allgather(&input::<T>(r, rows(r) * 3, ReduceOp::Sum, salt), 3)
            .expect("allgather");
        let want: Vec<T> = (0..n)
            .flat_map(|p| input::<T>(p, rows(p) * 3, ReduceOp::Sum, salt))
            .collect();
        assert_close(
            &gathered,
            &want,
            &format!("allgather {name} n={n} len {len}"),
        );

        // Alltoall: rank s sends split(s, p) elements to p, values tagged by sender and receiver.
        let split = |s: usize, p: usize| (len + s * 3 + p) % (len / 4 + 3);
        let tag = |s: usize, p: usize, i: usize| T::from_f64(((s * 13 + p * 7 + i) % 100) as f64);
        let splits: Vec<usize> = (0..n).map(|p| split(r, p)).collect();
        let send: Vec<T> = (0..n)
            .flat_map(|p| (0..split(r, p)).map(move |i| tag(r, p, i)))
            .collect();
        let (got, counts) = comm.alltoall(&send, &splits).expect("alltoall");
        let want: Vec<T> = (0..n)
            .flat_map(|s| (0..split(s, r)).map(move |i| tag(s, r, i)))
            .collect();
        assert_eq!(counts, (0..n).map(|s| split(s, r)).collect::<Vec<_>>());
        assert_close(&got, &want, &format!("alltoall {name} n={n} len {len}"));
    }
    comm.barrier().expect("barrier");
}

fn check_all(comm: &mut Communicator) {
    check_dtype::<u8>(comm);
    check_dtype::<i32>(comm);
    check_dtype::<i64>(comm);
    check_dtype::<f16>(comm);
    check_dtype::<bf16>(comm);
    check_dtype::<f32>(comm);
    check_dtype::<f64>(comm);
}

#[test]
fn world_of_1() {
    world(1, check_all);
}

#[test]
fn world_of_2() {
    world(2, check_all);
}

#[test]
fn world_of_3() {
    world(3, check_all);
}

#[test]
fn world_of_4() {
    world(4, check_all);
}

#[test]
fn world_of_7() {
    world(7, check_all);
}

/// More ranks than cores, whatever this machine has: only one rank per core reduces, and it
/// writes its finished block into every peer. Ranks given different counts still agree on one
/// (the union of their masks, capped by the smallest limit below a mask), so the layout is
/// the same everywhere.
#[test]
fn crowded_hosts() {
    for (n, cores) in [(4, 2), (3, 1), (5, 3)] {
        world_with(n, |cfg| cfg.cores = Some(cores), check_all);
    }
    world_with(
        4,
        |cfg| cfg.cores = Some(if cfg.rank == 0 { 3 } else { 2 }),
        check_all,
    );
}

/// The TCP ring, as between hosts: the worlds above share one process and so read each
/// other's buffers directly.
#[test]
fn worlds_of_3_and_4_over_tcp_only() {
    for n in [3, 4] {
        world_with(n, |cfg| cfg.same_host_copy = false, check_all);
    }
}

/// Several connections per peer: the ring stripes every segment over all of them.
#[test]
fn worlds_over_several_streams_per_peer() {
    for (n, streams) in [(2, 2), (3, 3), (4, 2)] {
        world_with(
            n,
            |cfg| {
                cfg.same_host_copy = false;
                cfg.streams = streams;
                cfg.segment_bytes = 4096; // many segments, stripes of odd sizes
            },
            check_all,
        );
    }
    // Across hosts, the cross-host ring of the hierarchical path stripes too.
    let ips = ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"];
    assert_eq!(check_on(&ips, |cfg| cfg.streams = 3), vec![true; 4]);
}

#[test]
fn allreduce_of_64_mib() {
    const LEN: usize = 16 << 20; // 64 MiB of f32
    let results = world(3, |comm| {
        let r = comm.rank();
        let mut buf: Vec<f32> = (0..LEN).map(|i| ((i + r) % 8) as f32).collect();
        comm.allreduce(&mut buf, ReduceOp::Sum).expect("allreduce");
        buf.iter()
            .enumerate()
            .all(|(i, &v)| v == (0..3).map(|r| ((i + r) % 8) as f32).sum::<f32>())
    });
    assert_eq!(results, vec![true; 3]);
}

#[test]
fn every_rank_gets_bit_identical_floats() {
    // Values whose sum depends on the order of addition: all ranks must still agree bit for bit.
    for (len, direct) in [(7usize, true), (100_000, true), (100_000, false)] {
        let results = world_with(
            4,
            |cfg| cfg.same_host_copy = direct,
            |comm| {
                let r = comm.rank();
                let mut buf: Vec<f32> =
                    (0..len).map(|i| 1.0 / ((i * 4 + r) as f32 + 0.1)).collect();
                comm.allreduce(&mut buf, ReduceOp::Sum).expect("allreduce");
                buf.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            },
        );
        assert!(
            results.iter().all(|r| r == &results[0]),
            "len {len} (same-host copy {direct}): ranks disagree"
        );
    }
}

/// Runs every check on a world over `ips`; returns whether each rank ran hierarchically.
fn check_on(ips: &[&str], tweak: impl Fn(&mut CommConfig) + Sync) -> Vec<bool> {
    world_on(ips, tweak, |comm| {
        check_all(comm);
        comm.is_hierarchical()
    })
}

/// Ranks on 127.0.0.2 and 127.0.0.3 form two hosts: allreduce runs on each host, then across.
#[test]
fn two_hosts_of_two_run_hierarchically() {
    let ips = ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"];
    assert_eq!(check_on(&ips, |_| {}), vec![true; 4]);
}

/// Hosts interleaved by rank (as a round-robin placement gives), three of them.
#[test]
fn three_interleaved_hosts_run_hierarchically() {
    let ips = [
        "127.0.0.2",
        "127.0.0.3",
        "127.0.0.4",
        "127.0.0.2",
        "127.0.0.3",
        "127.0.0.4",
    ];
    assert_eq!(check_on(&ips, |_| {}), vec![true; 6]);
}

/// Uneven hosts, one rank per host, or a rank that says no: the flat ring, still correct.
#[test]
fn hierarchy_only_where_it_applies() {
    let cases: [(&[&str], Option<usize>); 3] = [
        (&["127.0.0.2", "127.0.0.2", "127.0.0.3"], None),
        (&["127.0.0.2", "127.0.0.3", "127.0.0.4"], None),
        (
            &["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"],
            Some(3),
        ),
    ];
    for (ips, refuses) in cases {
        let modes = check_on(ips, |cfg| {
            cfg.hierarchical = Some(true);
            if Some(cfg.rank) == refuses {
                cfg.hierarchical = Some(false);
            }
        });
        assert_eq!(
            modes,
            vec![false; ips.len()],
            "{ips:?}, rank {refuses:?} refusing"
        );
    }
}

#[test]
fn hierarchical_results_are_bit_identical() {
    let ips = ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"];
    for op in [ReduceOp::Sum, ReduceOp::Average] {
        let results = world_on(
            &ips,
            |_| {},
            |comm| {
                let r = comm.rank();
                let mut buf: Vec<f32> = (0..300_001)
                    .map(|i| 1.0 / ((i * 4 + r) as f32 + 0.1))
                    .collect();
                comm.allreduce(&mut buf, op).expect("allreduce");
                buf.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            },
        );
        assert!(
            results.iter().all(|r| r == &results[0]),
            "{op:?}: ranks disagree"
        );
    }
}

/// Worlds that open every call in rounds (Bruck's allgather of descriptors and inline
/// payloads) instead of one message to every peer: every collective, every element type, over
/// TCP (so the payloads travel in the rounds, not in same-host mailboxes), on one address and
/// across hosts; and a world of 12, past the default, as it comes.
#[test]
fn worlds_that_open_in_rounds() {
    let rounds = |cfg: &mut CommConfig| {
        cfg.same_host_copy = false;
        cfg.direct_open_max = 1;
    };
    for n in [2, 3, 5, 8] {
        world_with(n, rounds, check_all);
    }
    // Three hosts of two: the cross-host communicator of the hierarchy opens in rounds too.
    let ips = [
        "127.0.0.2",
        "127.0.0.2",
        "127.0.0.3",
        "127.0.0.3",
        "127.0.0.4",
        "127.0.0.4",
    ];
    assert_eq!(check_on(&ips, |cfg| cfg.direct_open_max = 1), vec![true; 6]);
    world_with(12, |cfg| cfg.same_host_copy = false, check_all);
}
