//! What building a communicator's mesh costs as the world grows: `n` ranks (threads of this
//! process, each on its own 127.0.0.x address, as one-slot hosts) connect at once, and the
//! time until the last is connected is divided by the connections made (n(n−1)/2), so the cost
//! of a world this machine cannot hold can be estimated from it.
//!
//! ```text
//! cargo run --release -p hvd-collectives --example mesh_bench -- 8 16 32 64
//! ```

use std::net::{SocketAddr, TcpListener};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hvd_collectives::{CommConfig, Communicator};

fn main() -> anyhow::Result<()> {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse::<usize>()
                .with_context(|| format!("world size {a:?}"))
        })
        .collect::<anyhow::Result<_>>()?;
    let sizes = if sizes.is_empty() {
        vec![8, 16, 32, 64]
    } else {
        sizes
    };
    println!("# mesh of n one-slot hosts on this machine, median of 3 builds");
    println!(
        "{:>6} {:>8} {:>10} {:>14}",
        "ranks", "pairs", "build(ms)", "per pair(us)"
    );
    for n in sizes {
        if !(2..=250).contains(&n) {
            bail!("world size {n} is not within 2..=250");
        }
        let mut walls: Vec<Duration> = (0..3).map(|_| build(n)).collect::<anyhow::Result<_>>()?;
        walls.sort();
        let wall = walls[1];
        let pairs = n * (n - 1) / 2;
        println!(
            "{n:>6} {pairs:>8} {:>10.1} {:>14.1}",
            wall.as_secs_f64() * 1e3,
            wall.as_secs_f64() * 1e6 / pairs as f64
        );
    }
    Ok(())
}

/// Builds one world of `n`; the time from the common start until the last rank is connected.
fn build(n: usize) -> anyhow::Result<Duration> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|r| TcpListener::bind((format!("127.0.0.{}", 2 + r), 0)))
        .collect::<Result<_, _>>()
        .context("binding a rank's listener")?;
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .map(TcpListener::local_addr)
        .collect::<Result<_, _>>()
        .context("a listener's address")?;
    let start = Barrier::new(n);
    let t0 = thread::scope(|s| {
        let ranks: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let (addrs, start) = (&addrs, &start);
                s.spawn(move || {
                    let mut cfg = CommConfig::new(rank, n, "mesh-bench");
                    cfg.same_host_copy = false;
                    start.wait();
                    let t = Instant::now();
                    Communicator::connect(cfg, &l, addrs)
                        .map(|c| (t, Instant::now(), c))
                        .with_context(|| format!("rank {rank} connecting"))
                })
            })
            .collect();
        let mut first = None::<Instant>;
        let mut last = None::<Instant>;
        let mut comms = Vec::with_capacity(n);
        for h in ranks {
            let joined = h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))?;
            let (t, done, c) = joined?;
            first = Some(first.map_or(t, |f| f.min(t)));
            last = Some(last.map_or(done, |l| l.max(done)));
            comms.push(c);
        }
        Ok::<_, anyhow::Error>(last.zip(first).map(|(l, f)| l - f).unwrap_or_default())
    })?;
    Ok(t0)
}
