//! Worlds of in-process ranks connected over loopback, one thread per rank.

#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener};
use std::thread;
use std::time::Duration;

use hvd_collectives::{CommConfig, Communicator, Element, ReduceOp};

/// Runs `f` on every rank of a fresh world of `n` and returns the results by rank.
pub fn world<R: Send>(n: usize, f: impl Fn(&mut Communicator) -> R + Sync) -> Vec<R> {
    world_with(n, |_| {}, f)
}

/// As [`world`], with a hook to adjust every rank's config.
pub fn world_with<R: Send>(
    n: usize,
    tweak: impl Fn(&mut CommConfig) + Sync,
    f: impl Fn(&mut Communicator) -> R + Sync,
) -> Vec<R> {
    world_on(&vec!["127.0.0.1"; n], tweak, f)
}

/// A world whose rank `r` listens on `ips[r]`: ranks on one address form one host, so
/// 127.0.0.x addresses play several hosts.
pub fn world_on<R: Send>(
    ips: &[&str],
    tweak: impl Fn(&mut CommConfig) + Sync,
    f: impl Fn(&mut Communicator) -> R + Sync,
) -> Vec<R> {
    let n = ips.len();
    let listeners: Vec<TcpListener> = ips
        .iter()
        .map(|ip| TcpListener::bind((*ip, 0)).expect("bind"))
        .collect();
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr().expect("addr"))
        .collect();
    thread::scope(|s| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let (addrs, tweak, f) = (&addrs, &tweak, &f);
                s.spawn(move || {
                    let mut cfg = CommConfig::new(rank, n, "test-secret");
                    cfg.connect_timeout = Duration::from_secs(20);
                    tweak(&mut cfg);
                    let mut comm = Communicator::connect(cfg, &l, addrs).expect("connect");
                    f(&mut comm)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// The element types the tests build inputs and references for (in f64, through
/// [`Element::to_f64`] and [`Element::from_f64`]).
pub trait TestElem: Element + Copy {}

impl<T: Element + Copy> TestElem for T {}

/// What `op` makes of every rank's value `vals` (in a world of `n`), computed in f64 and
/// given in `T`: an average of an integer type truncates, as the collectives do.
pub fn reduced<T: TestElem>(vals: impl Iterator<Item = f64>, n: usize, op: ReduceOp) -> T {
    let v = match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Average => {
            let s: f64 = vals.sum();
            if T::from_f64(0.5).to_f64() == 0.0 {
                (s / n as f64).trunc()
            } else {
                s / n as f64
            }
        }
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Product => vals.product(),
        ReduceOp::Adasum => panic!("Adasum is no element-wise op: tests/adasum.rs checks it"),
    };
    T::from_f64(v)
}

/// Asserts `got` is `want`, exactly but for an average's one division, rounded once in the
/// element type; `what` names the call in the message.
pub fn assert_close<T: TestElem>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f64(), w.to_f64());
        assert!(
            (g - w).abs() <= w.abs() * 1e-2,
            "{what}: element {i} is {g}, expected {w}"
        );
    }
}
