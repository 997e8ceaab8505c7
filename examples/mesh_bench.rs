//! What building a communicator's mesh costs as the world grows: `n` ranks (threads of this
//! process, each on its own 127.0.0.x address, as one-slot hosts) connect at once, and the
//! time until the last is connected is divided by the pairs connected (every pair up to
//! `direct_open_max` ranks, about `n log2 n` beyond), so the cost of a world this machine
//! cannot hold can be estimated from it. `--full` connects every pair at any size, for the
//! comparison; `--alltoall` times a first alltoall after it, which connects the other pairs.
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

/// What one build of a world measured.
struct Built {
    /// From the common start until the last rank was connected.
    wall: Duration,
    /// Pairs of ranks connected.
    pairs: usize,
    /// From the common start of a first alltoall until the last rank was done, when asked.
    alltoall: Option<Duration>,
}

fn main() -> anyhow::Result<()> {
    let mut full = false;
    let mut alltoall = false;
    let mut sizes = Vec::new();
    for a in std::env::args().skip(1) {
        match a.as_str() {
            "--full" => full = true,
            "--alltoall" => alltoall = true,
            _ => sizes.push(
                a.parse::<usize>()
                    .with_context(|| format!("world size {a:?}"))?,
            ),
        }
    }
    if sizes.is_empty() {
        sizes = vec![8, 16, 32, 64];
    }
    let mesh = if full {
        "every pair"
    } else {
        "pairs as needed"
    };
    println!("# {mesh}, n one-slot hosts on this machine, median of 3 builds");
    println!(
        "{:>6} {:>8} {:>10} {:>14} {:>16}",
        "ranks", "pairs", "build(ms)", "per pair(us)", "1st alltoall(ms)"
    );
    for n in sizes {
        if !(2..=250).contains(&n) {
            bail!("world size {n} is not within 2..=250");
        }
        let mut runs: Vec<Built> = (0..3)
            .map(|_| build(n, full, alltoall))
            .collect::<anyhow::Result<_>>()?;
        runs.sort_by_key(|b| b.wall);
        let b = &runs[1];
        let first = b.alltoall.map_or_else(
            || "-".to_string(),
            |d| format!("{:.1}", d.as_secs_f64() * 1e3),
        );
        println!(
            "{n:>6} {:>8} {:>10.1} {:>14.1} {first:>16}",
            b.pairs,
            b.wall.as_secs_f64() * 1e3,
            b.wall.as_secs_f64() * 1e6 / b.pairs as f64
        );
    }
    Ok(())
}

/// Builds one world of `n` (every pair when `full`), then times a first alltoall when asked.
fn build(n: usize, full: bool, alltoall: bool) -> anyhow::Result<Built> {
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
    thread::scope(|s| {
        let ranks: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let (addrs, start) = (&addrs, &start);
                s.spawn(move || {
                    let mut cfg = CommConfig::new(rank, n, "mesh-bench");
                    cfg.same_host_copy = false;
                    if full {
                        cfg.direct_open_max = n;
                    }
                    start.wait();
                    let t = Instant::now();
                    let mut comm = Communicator::connect(cfg, &l, addrs)
                        .with_context(|| format!("rank {rank} connecting"))?;
                    let connected = Instant::now();
                    let peers = comm.connected_peers();
                    let exchanged = if alltoall {
                        start.wait();
                        let t = Instant::now();
                        let input = vec![rank as f32; n];
                        comm.alltoall(&input, &[])
                            .with_context(|| format!("rank {rank}'s alltoall"))?;
                        Some((t, Instant::now()))
                    } else {
                        None
                    };
                    // Every rank holds its connections until all are done.
                    start.wait();
                    drop(comm);
                    Ok::<_, anyhow::Error>(((t, connected), peers, exchanged))
                })
            })
            .collect();
        let mut span = Span::default();
        let mut exchange = Span::default();
        let mut ends = 0;
        for h in ranks {
            let joined = h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))?;
            let (connect, peers, exchanged) = joined?;
            span.add(connect);
            if let Some(e) = exchanged {
                exchange.add(e);
            }
            ends += peers;
        }
        Ok(Built {
            wall: span.length(),
            pairs: ends / 2,
            alltoall: exchange.first.map(|_| exchange.length()),
        })
    })
}

/// The earliest start and the latest end of the ranks' intervals.
#[derive(Default)]
struct Span {
    first: Option<Instant>,
    last: Option<Instant>,
}

impl Span {
    fn add(&mut self, (start, end): (Instant, Instant)) {
        self.first = Some(self.first.map_or(start, |f| f.min(start)));
        self.last = Some(self.last.map_or(end, |l| l.max(end)));
    }

    fn length(&self) -> Duration {
        self.last
            .zip(self.first)
            .map(|(l, f)| l - f)
            .unwrap_or_default()
    }
}
