//! The exactness oracle of elastic training: a counter whose every step is an allreduce at
//! the world's current size, so a lost, repeated or half-applied step shows in its totals.
//!
//! ```text
//! horovodrun -np 4 --min-np 2 --host-discovery-script ./discover.sh \
//!     target/release/examples/elastic_counter --steps 200 --commit-every 5 --step-ms 10
//! ```
//!
//! Each rank prints one JSON object a line on stdout: `start` (the `HOROVOD_*` slot variables
//! the launcher set, read before `init()` as scripts do), `step`, `commit`, `reset` (after each
//! re-rendezvous and sync) and, at the end, `done`. It exits non-zero with a message when the
//! ranks disagree on the step or the total, or when an allreduce result is not the world size.
//!
//! `--busy-at-step N --busy-ms M` makes the training thread sleep M ms once, after step N (on
//! every rank, or on `--busy-rank R` only): a long computation between two collectives, which
//! the driver must tell from a frozen process. It prints `busy` before the sleep.

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use clap::Parser;
use hvd::ReduceOp;
use hvd::elastic::{Object, State};
use serde::{Deserialize, Serialize};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Steps to run.
    #[arg(long)]
    steps: u64,
    /// Commit every K steps (other steps end with a host-update check).
    #[arg(long, default_value_t = 1)]
    commit_every: u64,
    /// Sleep after each step, in milliseconds.
    #[arg(long, default_value_t = 0)]
    step_ms: u64,
    /// Be busy once, after this step (with --busy-ms).
    #[arg(long, requires = "busy_ms")]
    busy_at_step: Option<u64>,
    /// How long to be busy, in milliseconds.
    #[arg(long, requires = "busy_at_step")]
    busy_ms: Option<u64>,
    /// Only this rank is busy (default: every rank).
    #[arg(long, requires = "busy_at_step")]
    busy_rank: Option<usize>,
    /// Run the collectives through the background engine, as the Python frameworks do: the
    /// engine measures how late each rank is, and rank 0 reports it to the driver.
    #[arg(long)]
    engine: bool,
}

/// The background engine of one round: stopped when the round's training ends, however it
/// ends, so that the elastic reset gets the communicator back.
struct RoundEngine(Option<hvd::Engine>);

impl Drop for RoundEngine {
    fn drop(&mut self) {
        if let Some(e) = self.0.take()
            && let Err(e) = hvd::stop_engine(e)
        {
            let _ = writeln!(
                std::io::stderr(),
                "elastic_counter: stopping the engine: {e}"
            );
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Counter {
    step: u64,
    total: i64,
    history: Vec<i64>,
}

/// Wall-clock milliseconds, so a bench can see gaps between steps across relaying drivers.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn emit(v: &serde_json::Value) {
    let mut out = std::io::stdout().lock();
    // A closed stdout ends the job anyway; the line is not worth a panic.
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

/// Ends the process when the ranks disagree: a broken invariant must never be trained past.
fn fail(msg: String) -> ! {
    eprintln!("elastic_counter: {msg}");
    std::process::exit(2);
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.commit_every == 0 {
        bail!("--commit-every must be at least 1");
    }
    let var = |k: &str| std::env::var(k).ok();
    emit(&json!({"event": "start", "horovod": {
        "rank": var("HOROVOD_RANK"), "size": var("HOROVOD_SIZE"),
        "local_rank": var("HOROVOD_LOCAL_RANK"), "local_size": var("HOROVOD_LOCAL_SIZE"),
        "cross_rank": var("HOROVOD_CROSS_RANK"), "cross_size": var("HOROVOD_CROSS_SIZE"),
        "hostname": var("HOROVOD_HOSTNAME"),
    }}));
    // hvd's own log on stderr, at `RUST_LOG` or `HOROVOD_LOG_LEVEL` (warnings by default).
    hvd::install_logging("warn").context("hvd's log settings")?;
    hvd::init().context("hvd::init")?;
    let mut state = State::new(Object(Counter::default()));
    let mut calls = 0u64;
    let mut busy_done = false;
    let result = hvd::elastic::run(&mut state, |state| {
        calls += 1;
        let (rank, size) = (hvd::rank()?, hvd::size()?);
        if calls > 1 {
            emit(&json!({"event": "reset", "step": state.step, "rank": rank, "size": size}));
        }
        let _engine = RoundEngine(if args.engine {
            Some(hvd::start_engine(hvd::engine_config()?)?)
        } else {
            None
        });
        while state.step < args.steps {
            let mut ones = vec![1i64; 16];
            hvd::allreduce(&mut ones, ReduceOp::Sum)?;
            if let Some(bad) = ones.iter().find(|&&x| x != size as i64) {
                fail(format!(
                    "rank {rank}: allreduce of ones gave {bad} in a world of {size}"
                ));
            }
            let mine = [state.step as i64, state.total];
            let (mut lo, mut hi) = (mine, mine);
            hvd::allreduce(&mut lo, ReduceOp::Min)?;
            hvd::allreduce(&mut hi, ReduceOp::Max)?;
            if lo != hi {
                fail(format!(
                    "rank {rank}: ranks disagree: step in {}..={}, total in {}..={}",
                    lo[0], hi[0], lo[1], hi[1]
                ));
            }
            state.total += size as i64;
            state.history.push(size as i64);
            state.step += 1;
            let step = state.step;
            emit(
                &json!({"event": "step", "step": step, "rank": rank, "size": size, "total": state.total, "at_ms": unix_ms()}),
            );
            if step % args.commit_every == 0 {
                let r = state.commit();
                emit(&json!({"event": "commit", "step": step, "rank": rank}));
                r?;
            } else {
                state.check_host_updates()?;
            }
            if args.step_ms > 0 {
                std::thread::sleep(Duration::from_millis(args.step_ms));
            }
            if let (Some(at), Some(ms)) = (args.busy_at_step, args.busy_ms)
                && step == at
                && !busy_done
                && args.busy_rank.is_none_or(|r| r == rank)
            {
                busy_done = true;
                emit(&json!({"event": "busy", "step": step, "rank": rank, "ms": ms}));
                std::thread::sleep(Duration::from_millis(ms));
            }
        }
        Ok((rank, size))
    });
    let (rank, size) = match result {
        Ok(v) => v,
        Err(hvd::Error::Removed { reason }) => {
            eprintln!("elastic_counter: removed from the job ({reason}); exiting");
            return Ok(());
        }
        Err(e) => return Err(e).context("elastic training failed"),
    };
    let c = &state.0;
    let history_sum: i64 = c.history.iter().sum();
    if c.total != history_sum || c.history.len() as u64 != args.steps {
        fail(format!(
            "rank {rank}: total {} but history sums to {history_sum} over {} steps (expected {})",
            c.total,
            c.history.len(),
            args.steps
        ));
    }
    emit(
        &json!({"event": "done", "rank": rank, "size": size, "steps": args.steps, "total": c.total, "history_sum": history_sum}),
    );
    hvd::shutdown()?;
    Ok(())
}
